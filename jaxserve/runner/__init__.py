"""The runner: the only host <-> device boundary of a step (one ModelRunner per engine).

model_runner.py      ModelRunner: state updates, dispatch / collect, bookkeeping
step_inputs.py       a step's padded host inputs (StepInputBuilder) and its records
programs.py          the jitted programs by program key, their packed input layouts
compilation_manager  programs compiled ahead of time: warm-up stages, background, cache
setup.py, dtypes.py, bucketing.py, kv_cache.py   set-up policy: mesh, dtypes, buckets, KV
input_batch.py, packed_inputs.py, program_key.py, executable_cache.py, compilation_cache.py
"""
