//! Fault injection, scenarios, invariant checks and reports.
