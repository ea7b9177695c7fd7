"""The leaf every package of the project may import: token trees and the proposer protocol
(`protocols`), sampling parameters (`sampling_params`) and the typed engine configuration
(`config`, with the lookahead cache's `lookahead_config`). It imports nothing else of the project, so `gpu_target`, `cpu_draft`,
`lookahead` and `ipc` depend on it and never on the engine above them (import-linter's
layers contract in pyproject.toml keeps it so)."""
