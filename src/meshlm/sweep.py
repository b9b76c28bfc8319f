"""``meshlm sweep``: a grid or successive-halving search over LR (and optionally global batch,
warm-up, init std and the width) on short proxy runs, each a normal ``meshlm pretrain`` process.

    meshlm sweep --lr 1e-3,3e-3,1e-2 --hidden-size 128,256 --sweep-dir DIR [--method halving]
                 [--target-hidden-size 4096] -- <pretrain flags, e.g. --use-mup --mock-data …>

The swept flags take comma lists of pretrain's values; the flags after ``--`` are every trial's
(except what the sweep sets per trial: --train-iters, --run-dir and the swept flags are refused there, and
so are --log-dir and --save, folders every trial would share).
Trials run in parallel, one per slot: a GPU each (CUDA_VISIBLE_DEVICES) when there are GPUs, else
--slots CPU processes; a trial is one process (TP = PP = 1) unless the flags give --nproc-per-node. A trial ends as ``ok`` (its loss: the last validation loss, else the mean of
its last three training losses), ``diverged`` (a NaN/inf loss, or a loss above --spike-factor × its
first one: a spike) or ``failed`` (another error, its last log line kept); the sweep goes on either
way. Each finished trial is one line of DIR/trials.jsonl, so a killed sweep started again with the
same flags runs only the trials that have no ok or diverged line yet (failed ones run again); its
pretrain flags after ``--`` must be the ones the lines record (another model's losses were reused).

Successive halving (Jamieson & Talwalkar 2016, "Non-stochastic Best Arm Identification and
Hyperparameter Optimization", Alg. 1): per width, every setting runs --train-iters; the best
1/--eta of them run again for eta × as many iterations, for --rungs rungs.

At the end: a table, DIR/sweep.html (loss against LR, one curve per width: report/sweep.py) and the
chosen values (the best trial of the widest proxy) as flags for the full run; under --use-mup with
--mup-base-hidden-size (default: the smallest swept width) they carry to --target-hidden-size
unchanged (Tensor Programs V: μP's optimum does not move with width), and the standard
parametrisation is said not to transfer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time

from . import metrics_json
from .errors import ConfigError

AXES = {"lr": float, "hidden_size": int, "global_batch_size": int, "lr_warmup_iters": int, "init_method_std": float}
EXAMPLES = {"lr": "1e-3,3e-3", "hidden_size": "256,512", "global_batch_size": "32,64", "lr_warmup_iters": "0,100",
            "init_method_std": "0.01,0.02"}  # each axis's own example in a fix
RESULTS = "trials.jsonl"
HALVING = {"rungs": 3, "eta": 2}  # successive halving's defaults (--rungs, --eta)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for name, kind in AXES.items():
        parser.add_argument("--" + name.replace("_", "-"), default=None, metavar="V1,V2,…",
                            help=f"values of pretrain's --{name.replace('_', '-')} to try ({kind.__name__}s)")
    parser.add_argument("--sweep-dir", required=True, help="the trials' run folders, trials.jsonl and sweep.html")
    parser.add_argument("--method", choices=["grid", "halving"], default="grid", help="every setting, or "
                        "successive halving")
    parser.add_argument("--train-iters", type=int, default=50, help="iterations of a proxy run (halving: rung 0)")
    parser.add_argument("--eta", type=int, default=None, help=f"halving: keep 1/eta, run eta × longer (default "
                        f"{HALVING['eta']})")
    parser.add_argument("--rungs", type=int, default=None, help=f"halving: rungs (default {HALVING['rungs']})")
    parser.add_argument("--slots", type=int, default=None, help="trials at once (default: the GPUs, or 1 on CPU)")
    parser.add_argument("--spike-factor", type=float, default=1.5, help="a loss above this × the first is a spike")
    parser.add_argument("--target-hidden-size", type=int, default=None, help="the full run's width, for the flags")
    parser.add_argument("pretrain", nargs=argparse.REMAINDER, help="-- then every trial's pretrain flags")


def _values(args) -> dict:
    """{axis: [values]} of the swept flags given; ConfigError naming a bad value."""
    out = {name: _axis_values(name, getattr(args, name)) for name in AXES if getattr(args, name) is not None}
    if "lr" not in out:
        raise ConfigError("meshlm sweep needs --lr V1,V2,… (the learning rates to try)")
    return out


def _axis_values(name: str, text: str) -> list:
    """The values of one swept flag's comma list; ConfigError naming a malformed, non-finite,
    out-of-range (negative; zero except for the warm-up) or repeated value."""
    kind, flag, parts = AXES[name], "--" + name.replace("_", "-"), text.split(",")
    try:
        vals = [kind(v) for v in parts]
    except ValueError:
        raise ConfigError(f"{flag} {text}: give comma-separated {kind.__name__}s, e.g. {flag} {EXAMPLES[name]}") from None
    low = 0 if name == "lr_warmup_iters" else None  # warm-up may be 0; everything else is positive
    bad = [p for p, v in zip(parts, vals) if not math.isfinite(v) or (v < low if low == 0 else v <= 0)]
    if bad:
        kind_word = "non-negative" if low == 0 else "positive"
        raise ConfigError(f"{flag} {text}: {bad[0].strip()!r} is not a finite {kind_word} value; give e.g. "
                          f"{flag} {EXAMPLES[name]}")
    if len(set(vals)) < len(vals):
        raise ConfigError(f"{flag} {text}: a value is listed twice; give each once")
    return vals


def _check(args) -> None:
    """ConfigError for a sweep flag outside its domain, or --rungs/--eta given to a grid sweep (which
    ignored them), before any trial starts; then the halving flags not given take ``HALVING``'s."""
    halving = [f"--{k} {getattr(args, k)}" for k in HALVING if getattr(args, k) is not None]
    if args.method == "grid" and halving:
        raise ConfigError(f"{' '.join(halving)}: successive halving's, and this sweep is --method grid (every "
                          f"setting at --train-iters); add --method halving or drop them")
    for k, default in HALVING.items():
        setattr(args, k, default if getattr(args, k) is None else getattr(args, k))
    rules = [("--train-iters", args.train_iters, 1), ("--rungs", args.rungs, 1), ("--eta", args.eta, 2),
             ("--slots", args.slots, 1), ("--target-hidden-size", args.target_hidden_size, 1)]
    for flag, value, least in rules:
        if value is not None and value < least:
            raise ConfigError(f"{flag} {value} is out of range: give {least} or more")
    if not (math.isfinite(args.spike_factor) and args.spike_factor > 1):
        raise ConfigError(f"--spike-factor {args.spike_factor} is out of range: give a number above 1, e.g. 1.5")
    from .folders import output_folder_problem
    problem = output_folder_problem("--sweep-dir", args.sweep_dir)
    if problem:
        raise ConfigError(problem)


def _finished(path: str, pretrain: list) -> dict:
    """{_key: record} of trials.jsonl's ok and diverged trials (a failed one runs again). A last line
    cut off by a kill is dropped from the file too (read_jsonl says so), so the next trial's line is
    not appended to it; a line that is no trial record is a ConfigError naming the file, and so is a
    trial of other pretrain flags than ``pretrain`` (each record's "pretrain"; a resume with another
    model after ``--`` reused the first model's losses and chose from them)."""
    from .folders import read_jsonl
    if not os.path.isfile(path):
        return {}
    records = [metrics_json.decode(r) for r in read_jsonl(path, ConfigError, "the trials.jsonl `meshlm sweep` wrote")]
    bad = next((r for r in records if not (isinstance(r, dict) and {"values", "iters", "status"} <= set(r))), None)
    if bad is not None:
        raise ConfigError(f"{path}: {str(bad)[:80]!r} is not a trial record; delete the file (its trials run again) "
                          f"or give another --sweep-dir")
    other = next((r["pretrain"] for r in records if r.get("pretrain", pretrain) != pretrain), None)
    if other is not None:
        raise ConfigError(f"--sweep-dir {os.path.dirname(path)} holds trials of other pretrain flags ({' '.join(other)}, "
                          f"now {' '.join(pretrain)}); give another --sweep-dir, or the flags after -- it ran with")
    with open(path, "rb") as fh:
        cut = fh.read().rstrip(b" \t")[-1:] not in (b"", b"\n")
    if cut:
        with open(path + ".tmp", "w") as fh:
            fh.writelines(metrics_json.dumps(r) + "\n" for r in records)
        os.replace(path + ".tmp", path)
    return {_key(r["values"], r["iters"]): r for r in records if r["status"] != "failed"}


def _check_trial_flags(args, base: list) -> None:
    """ConfigError for a pretrain flag after ``--`` that the sweep sets on every trial's command line
    itself (appended last, so the trial's own would be silently replaced): --train-iters (the sweep's
    --train-iters), --run-dir (a folder in --sweep-dir) and each swept flag; and the folders a trial
    must not share with the others: --log-dir (its metrics, which the sweep reads from the trial's
    run folder) and --save."""
    owned = {"--train-iters": "the sweep sets each trial's length: give it as `meshlm sweep --train-iters N` "
                              "(halving: rung 0's)",
             "--run-dir": "the sweep runs each trial in its own folder under --sweep-dir: drop it",
             "--log-dir": "every trial would log into that one folder, and the sweep reads each trial's "
                          "metrics from its own folder under --sweep-dir: drop it",
             "--save": "every trial would save into that one folder (and under --load of it resume another "
                       "trial's run): drop it"}
    owned.update({"--" + name.replace("_", "-"): f"the sweep sets each trial's value from its own "
                  f"--{name.replace('_', '-')} {getattr(args, name)}: drop one of the two"
                  for name in AXES if getattr(args, name) is not None})
    problems = []
    for i, tok in enumerate(base):
        flag, eq, value = tok.partition("=")
        if flag in owned:
            value = value if eq else (base[i + 1] if i + 1 < len(base) else "")
            problems.append(f"{flag} {value} after `--`: {owned[flag]}".replace("  ", " "))
    if problems:
        raise ConfigError(problems)


def _dry_run(base: list, settings: dict, iters: int, extra: list) -> None:
    """``meshlm pretrain --dry-run`` of one trial per width: every pretrain check (flags, data,
    layout) once, before any trial runs; ConfigError with its one line when it refuses."""
    import contextlib
    import io
    from .cli import main  # in this process: no interpreter start per check
    for group in settings.values():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["pretrain", *base, *_flags(group[0]), *extra, "--train-iters", str(iters), "--dry-run"])
            except SystemExit as e:  # argparse: an unknown or malformed flag
                code = e.code
        if code:
            lines = (err.getvalue().strip() or out.getvalue().strip() or f"exit {code}").splitlines()
            raise ConfigError(f"meshlm sweep: the trials' pretrain flags are refused: "
                              f"{lines[-1].removeprefix('meshlm: error: ')}")


def _flags(values: dict) -> list:
    return [tok for k, v in values.items() for tok in ("--" + k.replace("_", "-"), repr(v))]


def _key(values: dict, iters: int) -> str:
    return json.dumps({"values": values, "iters": iters}, sort_keys=True)


def _outcome(run_dir: str, rc: int, log: str, spike: float) -> dict:
    """{status, loss, note} of a finished trial from its metrics.jsonl and exit status."""
    path = os.path.join(run_dir, "logs", "metrics.jsonl")
    from .folders import read_jsonl
    recs = [metrics_json.decode(r) for r in read_jsonl(path, ConfigError, "a meshlm metrics.jsonl")
            if isinstance(r, dict)] if os.path.isfile(path) else []
    losses = [r["lm_loss"] for r in recs if "iter_ms" in r and r.get("lm_loss") is not None]
    evals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    bad = [x for x in losses + evals if not math.isfinite(x)]
    if bad or (losses and max(losses) > spike * losses[0]):
        what = "NaN/inf loss" if bad else f"loss spike {max(losses):.3g} > {spike} × first {losses[0]:.3g}"
        return {"status": "diverged", "loss": None, "note": what}
    if rc != 0 or not losses:
        tail = open(log, errors="replace").read().strip().splitlines()[-1:] if os.path.isfile(log) else []
        nan = tail and ("nan" in tail[0].lower() or "inf" in tail[0].lower())
        return {"status": "diverged" if nan else "failed", "loss": None, "note": (tail or [f"exit {rc}"])[0][:300]}
    loss = evals[-1] if evals else sum(losses[-3:]) / len(losses[-3:])
    return {"status": "ok", "loss": loss, "note": ""}


def _slots(args) -> list:
    """One entry per parallel slot: its CUDA_VISIBLE_DEVICES (None on CPU)."""
    import torch
    gpus = torch.cuda.device_count()
    n = args.slots or max(1, gpus)
    return [str(i % gpus) if gpus else None for i in range(n)]


def _run_trials(todo: list, args, base: list, done: dict) -> None:
    """Run (values, iters) trials that have no result yet, a slot each; append each result to
    trials.jsonl as it finishes, with the pretrain flags every trial shares ("pretrain": base)."""
    free, running = _slots(args), []
    todo = [t for t in todo if _key(*t) not in done]
    extra = _trial_flags(base)
    with open(os.path.join(args.sweep_dir, RESULTS), "a") as results:
        while todo or running:
            while todo and free:
                values, iters = todo.pop(0)
                slot = free.pop(0)
                name = "-".join(f"{k}={v}" for k, v in values.items()) + f"-iters={iters}"
                run_dir = os.path.join(args.sweep_dir, name)
                shutil.rmtree(run_dir, ignore_errors=True)  # a trial the killed sweep left unfinished
                os.makedirs(run_dir)
                log = os.path.join(args.sweep_dir, name + ".log")
                env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": slot} if slot is not None else {}))
                cmd = [sys.executable, "-m", "meshlm", "pretrain", *base, *_flags(values), *extra,
                       "--train-iters", str(iters), "--run-dir", run_dir]
                with open(log, "w") as out:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
                running.append((proc, values, iters, slot, run_dir, log))
            time.sleep(0.1)
            for item in [r for r in running if r[0].poll() is not None]:
                proc, values, iters, slot, run_dir, log = item
                running.remove(item)
                free.append(slot)
                rec = {"values": values, "iters": iters, **_outcome(run_dir, proc.returncode, log, args.spike_factor),
                       "pretrain": base}
                done[_key(values, iters)] = rec
                results.write(metrics_json.dumps(rec) + "\n")  # NaN as "NaN": valid JSON
                results.flush()
                print(f"meshlm sweep: {rec['status']:>8} {rec['loss'] if rec['loss'] is not None else '-':>10} "
                      f"{' '.join(_flags(values))} ({iters} iters) {rec['note']}", flush=True)


def _trial_flags(base: list) -> list:
    """One GPU or CPU slot a trial, so TP = PP = 1 unless the flags give --nproc-per-node or a size."""
    extra = [] if "--nproc-per-node" in base else ["--nproc-per-node", "1"]
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        extra += [] if flag in base or "--nproc-per-node" in base else [flag, "1"]
    return extra


def _best(recs: list) -> dict | None:
    ok = [r for r in recs if r["status"] == "ok"]
    return min(ok, key=lambda r: r["loss"]) if ok else None


def run(args: argparse.Namespace) -> int:
    """Run the sweep (see the module docstring); 0 when some trial ended ok, else 2 (ConfigError)."""
    base = [a for a in args.pretrain if a != "--"]
    _check(args)
    values = _values(args)
    _check_trial_flags(args, base)
    widths = sorted(values.pop("hidden_size", [None]), key=lambda w: w or 0)
    mup = "--use-mup" in base
    if mup and "--mup-base-hidden-size" not in base and widths != [None]:
        base += ["--mup-base-hidden-size", str(min(widths))]
    os.makedirs(args.sweep_dir, exist_ok=True)
    path = os.path.join(args.sweep_dir, RESULTS)
    done = _finished(path, base)
    if os.path.isfile(path):
        print(f"meshlm sweep: resuming, {len(done)} trial(s) already in {path}")
    grid = [dict(zip(values, combo)) for combo in itertools.product(*values.values())]
    settings = {w: [({"hidden_size": w} if w else {}) | g for g in grid] for w in widths}
    _dry_run(base, settings, args.train_iters, _trial_flags(base))
    _check_target(base, args.target_hidden_size)
    rungs = args.rungs if args.method == "halving" else 1
    final, rows = {}, []
    for rung in range(rungs):
        iters = args.train_iters * args.eta ** rung
        _run_trials([(s, iters) for group in settings.values() for s in group], args, base, done)
        for w, group in settings.items():
            recs = [done[_key(s, iters)] for s in group]
            final[w] = recs
            rows += recs
            ok = sorted((r for r in recs if r["status"] == "ok"), key=lambda r: r["loss"])
            settings[w] = [r["values"] for r in ok[:max(1, math.ceil(len(group) / args.eta))]]
        if all(len(g) <= 1 for g in settings.values()):
            break
    return _finish(args, final, rows, base, mup, widths)


def _check_target(base: list, target) -> None:
    """ConfigError, before any trial, when the full run's model (the trials' flags at
    --target-hidden-size) has a shape pretrain refuses (``validate.shape_problems``: heads not
    dividing the width, …): the sweep ended by printing flags of a run that cannot start."""
    if not target:
        return
    from .cli import _config_and_source, build_parser
    from .validate import shape_problems
    cfg, _ = _config_and_source(build_parser("pretrain").parse_args(["pretrain", *base, "--hidden-size", str(target)]))
    problems = shape_problems(cfg)
    if problems:
        raise ConfigError(f"--target-hidden-size {target}: the full run would be refused: "
                          f"{problems[0].removeprefix('meshlm: error: ')}")


def _mup_flags(base: list) -> list:
    """--use-mup and every --mup-* flag (with its value) of the trials' pretrain flags."""
    out = ["--use-mup"]
    for i, tok in enumerate(base):
        if tok.startswith("--mup-") and i + 1 < len(base):
            out += [tok, base[i + 1]]
    return out


def _finish(args, final: dict, rows: list, base: list, mup: bool, widths: list) -> int:
    """Print the table (every trial of every rung), write sweep.html, print the chosen flags (the
    best trial of the widest proxy's last rung)."""
    from .report.sweep import write_page
    print(f"{'status':>8} {'loss':>10}  flags")
    for r in rows:
        loss = f"{r['loss']:.4f}" if r["loss"] is not None else "-"
        print(f"{r['status']:>8} {loss:>10}  {' '.join(_flags(r['values']))} ({r['iters']} iters) {r['note']}")
    best = _best(final[widths[-1]]) or _best([r for w in widths for r in final[w]])
    page = write_page(os.path.join(args.sweep_dir, "sweep.html"), rows)
    print(f"meshlm sweep: {page}")
    if best is None:
        raise ConfigError(f"meshlm sweep: no trial ended ok (see {os.path.join(args.sweep_dir, RESULTS)}); "
                          "lower --lr, or check the trials' logs")
    chosen = {k: v for k, v in best["values"].items() if k != "hidden_size"}
    flags = _flags(chosen)
    if args.target_hidden_size and mup:
        flags = _mup_flags(base) + ["--hidden-size", str(args.target_hidden_size)] + flags
    print("meshlm sweep: chosen for the full run: " + " ".join(flags))
    if args.target_hidden_size and not mup:
        print("meshlm sweep: note: under the standard parametrisation the best LR moves with the width "
              "(Tensor Programs V, Fig. 1); sweep with --use-mup to carry it to --target-hidden-size")
    return 0
