//! The process's allocator: mimalloc. The request path allocates and frees many small buffers
//! on two threads, which glibc's allocator spends about a tenth of the gateway's CPU on; mimalloc
//! also returns freed memory to the system instead of keeping a peak's worth resident.
//! `--features system-allocator` builds with the system allocator instead, for heap profilers
//! that hook malloc.

#[cfg(not(feature = "system-allocator"))]
pub use mimalloc::return_freed_memory;

/// Nothing to return: the system allocator trims on its own.
#[cfg(feature = "system-allocator")]
pub fn return_freed_memory() {}

#[cfg(not(feature = "system-allocator"))]
#[allow(unsafe_code)]
mod mimalloc {
    use std::alloc::{GlobalAlloc, Layout};

    use libmimalloc_sys as mi;

    #[global_allocator]
    static ALLOCATOR: Mimalloc = Mimalloc;

    /// mimalloc as Rust's allocator. A layout whose alignment `mi_malloc` gives anyway takes
    /// the plain entry points; the aligned ones check the alignment on every call, about a tenth
    /// of what a small allocation costs.
    struct Mimalloc;

    /// The alignment `mi_malloc` guarantees to a block at least this large (`MI_MAX_ALIGN_SIZE`).
    const PLAIN_ALIGN: usize = 16;

    /// Whether a block of `size` bytes from the plain entry points is aligned enough for
    /// `align` (the rule the standard library's system allocator uses for `malloc`).
    fn plain(align: usize, size: usize) -> bool {
        align <= PLAIN_ALIGN && align <= size
    }

    // SAFETY: every block comes from mimalloc and goes back to it: plain blocks are aligned to
    // at least the layout's alignment (see `plain`), the others come from the aligned entry
    // points, and `mi_free` and `mi_realloc*` take blocks from either.
    unsafe impl GlobalAlloc for Mimalloc {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: a plain C allocation; the caller handles a null result.
            unsafe {
                match plain(layout.align(), layout.size()) {
                    true => mi::mi_malloc(layout.size()).cast(),
                    false => mi::mi_malloc_aligned(layout.size(), layout.align()).cast(),
                }
            }
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: as in `alloc`.
            unsafe {
                match plain(layout.align(), layout.size()) {
                    true => mi::mi_zalloc(layout.size()).cast(),
                    false => mi::mi_zalloc_aligned(layout.size(), layout.align()).cast(),
                }
            }
        }

        unsafe fn dealloc(&self, block: *mut u8, _layout: Layout) {
            // SAFETY: `block` came from this allocator, which is mimalloc.
            unsafe { mi::mi_free(block.cast()) }
        }

        unsafe fn realloc(&self, block: *mut u8, layout: Layout, size: usize) -> *mut u8 {
            // SAFETY: `block` came from this allocator; the new block keeps the alignment.
            unsafe {
                match plain(layout.align(), size) {
                    true => mi::mi_realloc(block.cast(), size).cast(),
                    false => mi::mi_realloc_aligned(block.cast(), size, layout.align()).cast(),
                }
            }
        }
    }

    /// Hands the memory this thread freed back to the system: mimalloc purges freed pages a
    /// second after the free, but only when the freeing thread next calls into the allocator,
    /// which a lane whose connections all went idle (and parked) does not; the lanes call this
    /// once a second.
    pub fn return_freed_memory() {
        // SAFETY: `mi_collect` works on the calling thread's own heap and takes no pointers;
        // with `force` false it frees empty pages and runs the purges that are due, nothing else.
        unsafe { mi::mi_collect(false) };
    }
}

#[cfg(test)]
#[allow(unsafe_code, clippy::unwrap_used)]
mod tests {
    use std::alloc::{alloc_zeroed, dealloc, realloc, Layout};

    #[test]
    fn blocks_are_aligned_as_asked_and_keep_their_bytes_when_resized() {
        for align in [1, 2, 8, 16, 32, 64, 4096] {
            for size in [1_usize, 7, 8, 15, 16, 17, 100, 5000, 100_000] {
                for resized in [size * 3, size.div_ceil(2)] {
                    let layout = Layout::from_size_align(size, align).unwrap();
                    // SAFETY: the layouts are not empty, each block is used within its size and
                    // freed once, with the layout it has then.
                    unsafe {
                        let block = alloc_zeroed(layout);
                        assert!(!block.is_null());
                        assert_eq!(block as usize % align, 0, "{size} bytes at {align}");
                        assert!((0..size).all(|i| *block.add(i) == 0));
                        block.write_bytes(0xa5, size);
                        let moved = realloc(block, layout, resized);
                        assert_eq!(moved as usize % align, 0, "{size} -> {resized} at {align}");
                        assert!((0..size.min(resized)).all(|i| *moved.add(i) == 0xa5));
                        dealloc(moved, Layout::from_size_align(resized, align).unwrap());
                    }
                }
            }
        }
    }
}
