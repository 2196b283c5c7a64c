"""`kill -USR1 <pid>` makes a running service log every thread's stack and every
asyncio task's await chain, and it goes on running (runner.dump_stacks): what an
operator, or a test whose job stalled, reads to see what a silent service waits for."""

import time


def test_sigusr1_logs_where_a_service_waits_and_it_goes_on(services):
    p = services.start("scheduler")
    deadline = time.monotonic() + 60
    while "ready on" not in services.logs(None):
        assert p.poll() is None and time.monotonic() < deadline, services.logs()
        time.sleep(0.2)
    dumps = services.dump_stacks()
    assert dumps == 1, services.logs()
    log = services.logs(None)
    dump = log[log.index("stacks on request (SIGUSR1)"):]
    assert f"scheduler (pid {p.pid})" in log and "thread 0x" in dump.lower(), dump
    # the service's main task, down to where its body waits
    assert "in run_until_stopped" in dump and "services/scheduler/service.py" in dump, dump
    assert p.poll() is None
    services.stop_all()
    assert p.returncode == 0, services.logs()
