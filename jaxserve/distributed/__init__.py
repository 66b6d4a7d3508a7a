"""Multi-process (multi-host) building blocks below the engine and the runner.

- cluster.py: join a JAX multi-controller cluster (launcher detection,
  initialize_distributed) and ask which process this is (is_multihost, is_leader);
- step_channel.py: the leader's per-step messages to the followers (StepChannel)
  and the followers' replay loop (run_follower);
- watchdog.py: heartbeats, and the watchdog that ends a process whose peer died;
- arrays.py: host arrays onto shardings that span processes (global_array).
"""
