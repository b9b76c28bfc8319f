"""bench/mup_transfer.py's record and bench/mup_transfer_plot.py's figure (issue 30): every trial's
loss is recorded (None for a diverged one), and the figure draws one curve per width and
parametrisation with a point per ok trial, diverged trials left out and counted in the legend."""

import json
import os
import sys
import xml.etree.ElementTree as ET

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH)


def _trial(w, lr, loss):
    return {"values": {"hidden_size": w, "lr": lr}, "iters": 4, "status": "ok" if loss else "diverged",
            "loss": loss, "note": ""}


def test_record_losses_and_figure(tmp_path):
    import mup_transfer
    import mup_transfer_plot

    rows = {"mup": [_trial(64, 2.0 ** -9, 5.5), _trial(64, 2.0 ** -8, 5.25), _trial(256, 2.0 ** -9, 5.0),
                    _trial(256, 2.0 ** -8, 5.125)],
            "standard": [_trial(64, 2.0 ** -9, 5.5), _trial(64, 2.0 ** -8, 5.25), _trial(256, 2.0 ** -9, 5.0),
                         _trial(256, 2.0 ** -8, None)]}
    losses = {k: mup_transfer.losses(r) for k, r in rows.items()}
    assert losses["standard"] == {"64": {"0.00195312": 5.5, "0.00390625": 5.25},
                                  "256": {"0.00195312": 5.0, "0.00390625": None}}
    assert mup_transfer.best_lrs(rows["mup"]) == {64: (2.0 ** -8, 5.25), 256: (2.0 ** -9, 5.0)}
    rec = {"bench": "mup_transfer", "gpu": "cpu", "date": "2026-12-03", "iters": 4, "widths": "64,256",
           "bf16": False, "losses": losses, "spread": {"mup": 2.0, "standard": 2.0},
           "best": {k: {str(w): v for w, v in mup_transfer.best_lrs(r).items()} for k, r in rows.items()}}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"bench": "mup_transfer"}) + "\n" + json.dumps(rec) + "\n")
    svg = ET.fromstring(mup_transfer_plot.figure(mup_transfer_plot.newest_record(str(path))))
    drawn = [(g.get("data-series"), int(g.get("data-points"))) for g in svg.iter("{http://www.w3.org/2000/svg}g")
             if g.get("data-series")]
    assert drawn == [("width 64", 2), ("width 256", 2), ("width 64", 2), ("width 256 (1 diverged)", 1)]
    titles = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text") if t.text and "best lr" in t.text]
    assert titles == ["μP: best lr 2^-8, 2^-9", "standard parametrisation: best lr 2^-8, 2^-9"]
