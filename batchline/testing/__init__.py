"""The test harness, shared by the test suite and the benchmarks (needs the [dev] extra): the
meshes (`in_process` in one process, `processes` as real subprocesses, and `probe`, what is seen
of those from outside), `up` (the `batchline up` command as a subprocess), the Redis topologies
(`cluster`, `sentinel`), the load that checks every answer (`load`) and the fault tests' verdicts
on it (`verdicts`), what the tests build or serve (`onnx_models`, `stateful_models`,
`triton_models`, `decoder`, `certs`, `auth_files`, `otlp_receiver`, `compose_config`), the one
polling helper (`polling`) and where the checkout is (`checkout`)."""
