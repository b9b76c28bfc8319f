"""Bad inputs a newcomer's launch script produced (found by trying meshlm from its README): each is
refused before any worker starts, in one line naming the flag, never a traceback or another run."""

import pytest

from meshlm.cli import main

SHAPE = ["pretrain", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2"]


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err and "embedded default" not in out.out
    return out.err.strip()


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"])
def test_a_data_flag_without_a_prefix_is_refused_not_replaced_by_the_embedded_default(tmp_path, capsys, flag):
    """`--data-path $DATA_PATH` with DATA_PATH unset used to train the embedded default corpus."""
    err = _refused(capsys, SHAPE + ["--run-dir", str(tmp_path / "run"), flag, "--dry-run"])
    assert f"{flag} is given without a prefix" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_empty_data_args_file_is_refused_before_any_worker(tmp_path, capsys):
    args = tmp_path / "args.txt"
    args.write_text("\n")
    err = _refused(capsys, SHAPE + ["--vocab-size", "64", "--tokenizer-type", "NullTokenizer",
                                    "--data-args-path", str(args), "--dry-run"])
    assert f"--data-args-path {args}: the file holds no dataset prefix" in err


def test_dry_run_names_a_tokenizer_file_of_the_wrong_kind(tmp_path, capsys):
    for name in ("d_text_document.bin", "d_text_document.idx"):
        (tmp_path / name).write_bytes(b"x")
    bad = tmp_path / "sp.model"
    bad.write_bytes(b"\xff\xfe not a tokenizer.json")
    err = _refused(capsys, SHAPE + ["--data-path", str(tmp_path / "d_text_document"), "--tokenizer-type",
                                    "HuggingFaceTokenizer", "--tokenizer-model", str(bad), "--dry-run"])
    assert f"--tokenizer-model {bad}" in err and len(err.splitlines()) == 1
