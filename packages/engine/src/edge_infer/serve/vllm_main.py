"""vLLM's OpenAI server as `edge-infer serve` runs it, with one change: a dead engine is a
non-zero exit.

vLLM 0.32's API server shuts down when its engine core dies (`launcher.terminate_if_errored`
sets uvicorn's `should_exit`) and then returns normally, so the process exits 0. A supervisor
(`docker run --restart on-failure`, systemd, Kubernetes) then takes a crash for a clean stop and
never restarts it. Here the check is wrapped: when it finds the engine dead, the exit code is
ENGINE_DIED.
"""

from __future__ import annotations

import sys

ENGINE_DIED = 3


def main() -> int:
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.serve.exception_handling.handlers import vllm_error

    died = []
    upstream = launcher.terminate_if_errored

    def terminate_if_errored(server, engine):
        if engine.errored and not engine.is_running:
            died.append(True)
        upstream(server, engine)

    # Both callers look the name up in their own module at call time: the watchdog loop
    # (launcher) and the handler of engine errors raised inside a request (vllm_error).
    launcher.terminate_if_errored = terminate_if_errored
    vllm_error.terminate_if_errored = terminate_if_errored

    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    vllm_main()
    if died:
        print("edge-infer serve: the vLLM engine died (see the error above); exiting with "
              f"status {ENGINE_DIED} so that a supervisor restarts the server", file=sys.stderr)
        return ENGINE_DIED
    return 0


if __name__ == "__main__":
    sys.exit(main())
