//! Process-wide allocator setting for programs that move checkpoint-sized buffers.

/// Buffers at least this big are mapped on their own and unmapped when freed.
const MMAP_THRESHOLD_BYTES: i32 = 1024 * 1024;

/// Makes glibc's malloc give freed chunk buffers back to the system at once, so a process's
/// resident memory follows the bytes it holds. Call once, early in `main`; a no-op elsewhere
/// than Linux with glibc.
///
/// glibc maps large allocations on their own, but after each such block is freed it raises
/// that threshold to the block's size (up to 32 MiB). From then on, chunk buffers of 8-32 MiB
/// (stored bytes, decoded bytes, planes) come from the heap arenas of whichever blocking-pool
/// thread allocates them, and what is freed there mostly stays in the process: compressed
/// saves and restores were seen 8-230 MiB over their stated bound (`BENCHMARKS.md`). A fixed
/// threshold turns the adjustment off.
pub fn release_freed_buffers_eagerly() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a malloc parameter; it is called before any buffer of this
    // size is allocated and takes no pointers.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES);
    }
}
