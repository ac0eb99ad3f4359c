//! Harness for the integration tests: placeholder until written.
