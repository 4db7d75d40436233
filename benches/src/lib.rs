//! Benchmarks live in `benches/*.rs` (`cargo bench -p benches`).
