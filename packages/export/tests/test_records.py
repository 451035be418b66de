"""The record's printers, and the corpus/CLI plumbing that needs no model."""

import json

import pytest

from edge_export import records
from edge_infer import corpus
from edge_infer.api import missing_provenance
from edge_infer.cli import build_parser
from edge_infer.errors import EdgeInferError


def _record(target, backend, sqnr, samples=None, needs=None, **kw):
    r = {"model": "m", "unit": "decoder", "target": target, "backend": backend,
         "sqnr_db": sqnr, "sink_prefix": {"token_id": 1},
         "measured": "pte" if backend == "xnnpack" else "simulated",
         "size_bytes": 3 * 2**20, "export_s": 12.3, "needs": needs,
         "calibration": None if samples is None else
         {"corpus": "lee", "samples": samples, "tokens": samples * 128},
         "eval": {"corpus": "shakespeare", "sequences": 4, "tokens_per_sequence": 128,
                  "protocol": "carried cache"},
         "shape": {"chunk": 32, "context": 128}}
    r.update(kw)
    return records.stamp(r)


def test_append_load_render(tmp_path):
    path = tmp_path / "export.jsonl"
    records.append(path, _record("xnnpack-fp32", "xnnpack", 112.5, target_sqnr_db=100.0))
    records.append(path, _record("qnn-w8a16", "qnn", 8.0, samples=16, needs="QNN SDK to lower"))
    records.append(path, _record("qnn-w8a16", "qnn", 35.2, samples=16, needs="QNN SDK to lower",
                                 target_sqnr_db=30.0))  # newer: replaces the 8.0 row
    records.append(path, _record("qnn-w8a16", "qnn", 12.0, samples=0, needs="QNN SDK to lower"))
    records.append(path, _record("xnnpack-fp32", "xnnpack", float("inf")))
    records.append(path, _record("qnn-w8a16", "qnn", 20.0, samples=16, sink_prefix=None))
    loaded = records.load(path)
    assert len(loaded) == 6 and loaded[-2]["sqnr_db"] == "inf"  # JSON has no inf
    md = records.render_markdown(loaded)
    assert "| m | decoder | qnn-w8a16 | lee x16 (2048 tok) | 35.2 | simulated |" in md
    assert "| 8.0 |" not in md
    assert "none (tracing example only) | 12.0" in md
    assert "QNN SDK to lower" in md
    assert "needs AI Hub credentials" in md  # no aihub record: the row says what it needs
    assert "qnn-w8a16 (lee x16 (2048 tok)): 35.2 dB vs >= 30.0 dB: met" in md
    assert "| inf |" in md
    assert "| qnn-w8a16 (no sink prefix) | lee x16 (2048 tok) | 20.0 |" in md


def test_stamp_has_provenance():
    with records.guard().observe("nothing") as verdict:
        pass
    r = records.stamp({}, verdict)
    assert set(r) >= {"versions", "machine", "git_commit", "created", "schema"}
    assert r["versions"]["torch"] and r["machine"]["cpu_model"]
    assert missing_provenance(r) == [] and r["guard_threshold"] > 0
    json.dumps(r)


def test_a_published_record_without_provenance_is_refused(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    with pytest.raises(ValueError, match="lacks .*guard"):
        records.append(results / "export.jsonl", records.stamp({}))  # no verdict
    assert not (results / "export.jsonl").exists()
    records.append(tmp_path / "scratch.jsonl", {"kind": "scratch"})  # not published: free


def test_builtin_tokens_are_deterministic_and_in_range():
    a = corpus.token_windows("builtin", 3, 16, vocab=100)
    b = corpus.token_windows("builtin", 3, 16, vocab=100)
    assert [w.shape for w in a] == [(1, 16)] * 3
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert all(int(w.max()) < 100 and int(w.min()) >= 0 for w in a)
    assert not (a[0] == a[1]).all()


def test_corpus_checksum_is_enforced(monkeypatch, tmp_path):
    import zipfile

    def fake_download(source, dest):
        wheel = dest / "gensim-4.4.0-cp311-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(source.member, "not the corpus")
        return wheel

    monkeypatch.setattr(corpus, "_download", fake_download)
    with pytest.raises(EdgeInferError, match="sha256"):
        corpus.corpus_text("lee")
    assert not (corpus.corpora_dir() / "lee.txt").exists()


def test_export_command_is_registered():
    parser = build_parser()
    args = parser.parse_args(["export", "m", "--target", "xnnpack-8da4w", "--out", "o"])
    assert args.command == "export" and args.target == "xnnpack-8da4w"
    assert args.calibration == 16 and args.unit == "decoder"
