"""The soak's record, with the server and the load stubbed out: what it says of itself."""

import json
from types import SimpleNamespace

from edge_infer.serve import soak
from edge_infer.testing import provenance_gaps


def test_the_soak_record_carries_its_provenance_and_what_the_guard_saw(monkeypatch, tmp_path):
    tally = soak.Tally()
    for i in range(10):
        tally.add("answered", 0.1 * (i + 1))
    monkeypatch.setattr(soak.process, "start",
                        lambda *a, **kw: (SimpleNamespace(pid=1), "http://127.0.0.1:1"))
    monkeypatch.setattr(soak.process, "stop", lambda proc: None)
    monkeypatch.setattr(soak, "served_name", lambda base, key: "m")
    monkeypatch.setattr(soak, "run_load", lambda *a: tally)
    monkeypatch.setattr(soak, "tree_rss_mib", lambda pid: 100.0)
    monkeypatch.setattr(soak, "answers", lambda *a: True)
    out = tmp_path / "soak.jsonl"
    monkeypatch.setattr("sys.argv", ["soak.py", "--minutes", "0.1", "--out", str(out)])
    assert soak.main() == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["kind"] == "soak" and rec["answered"] == 10
    assert provenance_gaps(rec) == [] and rec["guard"] in ("ok", "contended")
    assert rec["command"].endswith(" --minutes 0.1 --out " + str(out))
