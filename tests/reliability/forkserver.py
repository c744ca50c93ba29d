"""A fork server for `opd` processes: imports torch/transformers/peft/stages once, then forks one
child per request that runs `stages.cli.main(argv)` — exactly what the `opd` console script runs —
in its own working dir, environment and stdout/stderr files.

Starting `opd` costs ~5 s of imports on the shared CI cores; the fault-injection suite starts ~40
processes, so this is what keeps it inside its time budget. Children are real processes: they are
SIGKILLed, signalled and exit on their own exactly as `opd` would. Protocol (JSON lines on stdin ->
stdout): {"op": "start", argv, cwd, env, stdout, stderr} -> {"pid"}; {"op": "wait", pid} -> {"rc", "cpu_s"}
(negative: killed by that signal, as subprocess reports it).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import traceback


def child(req: dict) -> None:
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        for target, path in ((1, req["stdout"]), (2, req["stderr"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        for k, v in req.get("env", {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        from stages import cli

        try:
            rc = cli.main(req["argv"])
        except SystemExit as e:  # argparse errors, `opd doctor`
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        # what interpreter exit does for `opd` (joins threads, e.g. a background publish) without
        # running the fork server's own atexit handlers
        import threading

        threading._shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(rc)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # first, as `opd` does: MKL_CBWR is set before anything imports torch (MKL reads it once, at
    # its first call, and every child forked below inherits that MKL state)
    from stages.tools.process import process_settings

    process_settings()
    import tracer

    tracer.install()  # before the libraries below bind safetensors/pyarrow readers
    import warnings

    warnings.filterwarnings("ignore")
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import importlib
    import pkgutil

    import stages
    from stages.tools import process

    # every module of the package now, so all children run one snapshot of the code (the working
    # tree may change under a long session; a lazy import in a child would read the new file)
    for m in pkgutil.walk_packages(stages.__path__, "stages."):
        try:
            importlib.import_module(m.name)
        except Exception:  # optional extras (e.g. CUDA-only modules): imported lazily if ever
            pass

    process.quiet_libraries()
    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "start":
            pid = os.fork()
            if pid == 0:
                child(req)
            reply = {"pid": pid}
        elif req["op"] == "wait":
            _, status, ru = os.wait4(req["pid"], 0)
            reply = {"rc": os.waitstatus_to_exitcode(status), "cpu_s": ru.ru_utime + ru.ru_stime}
        else:
            reply = {"error": f"unknown op {req['op']!r}"}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
