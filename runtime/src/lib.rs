//! The elastic-run node agent and the worker client libraries.
