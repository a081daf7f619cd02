//! Sharded, streaming, atomically committed checkpoints in object storage.
