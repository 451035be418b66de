"""The experiment grids the nox sessions run (plans.toml, shipped in the package): every model
is a registry model and every build an engine spec `bench run` accepts, so a typo fails here
and not an hour into `nox -s bench-x86`."""

import tomllib
from importlib import resources

import pytest

from edge_harness.bench.run import parse_engine
from edge_infer.models.registry import REGISTRY

PLANS = tomllib.loads((resources.files("edge_harness") / "plans.toml").read_text())
BENCH = PLANS["bench"]
GRIDS = [(model, BENCH["engines"]) for model in BENCH["models"]]
GRIDS += [(BENCH["spark"]["model"], BENCH["spark"]["engines"])]
GRIDS += [(model, BENCH["executorch"]["engines"]) for model in BENCH["executorch"]["models"]]
GRIDS += list(PLANS["fidelity"].items())
GRIDS += list(PLANS["tasks"].items())
SERVE = PLANS["serve"]
GRIDS += [(run["model"], SERVE["engines"]) for run in SERVE["runs"]]


@pytest.mark.parametrize(("model", "engines"), GRIDS, ids=[m for m, _ in GRIDS])
def test_every_planned_build_is_one_bench_run_accepts(model, engines):
    assert model in REGISTRY
    specs = engines.split(",")
    assert specs and all(specs), engines
    for spec in specs:
        parse_engine(spec)


def test_the_plan_has_what_the_noxfile_reads():
    assert set(PLANS) == {"bench", "fidelity", "tasks", "serve"}
    assert set(BENCH) == {"models", "engines", "spark", "executorch"}
    assert set(BENCH["spark"]) == {"model", "engines"}
    assert set(BENCH["executorch"]) == {"models", "engines"}
    assert all(isinstance(v, str) for v in PLANS["fidelity"].values())


@pytest.mark.parametrize(("model", "builds"), list(PLANS["tasks"].items()), ids=list(PLANS["tasks"]))
def test_every_task_grid_holds_each_engines_base(model, builds):
    from edge_harness.tasks.run import base_of

    specs = [parse_engine(s) for s in builds.split(",")]
    labels = {f"{s.engine}:{s.quant}" for s in specs}
    assert {base_of(s) for s in specs} <= labels, "flips are paired against these"


def test_every_serve_run_is_one_bench_serve_accepts():
    from edge_harness.bench.serve import ServePlan, check
    from edge_harness.cli import _ints

    assert set(SERVE) == {"engines", "runs"} and SERVE["runs"]
    for run in SERVE["runs"]:
        assert set(run) == {"model", "concurrency"}
        check(ServePlan(model=run["model"], engines=[parse_engine(s) for s in
                                                      SERVE["engines"].split(",")],
                        concurrency=_ints(run["concurrency"])))
