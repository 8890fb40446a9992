"""The sandbox that runs model-written Python: bubblewrap with a seccomp filter, a cgroup and a
private uid per call (docs/sandbox.md). `runner.py` is the entry point (`run_sandboxed`); the other
modules are its parts: the bwrap command line, the cgroup, the seccomp filter, uid leases, and
the parent's side of one call."""
