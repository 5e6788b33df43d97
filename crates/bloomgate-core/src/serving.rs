//! Which data-plane serving thread the caller runs on, for parts shared by all of them
//! that keep per-thread state (the upstream client's pools). Set by
//! `server::serve_per_core` on each of its threads; a leaf, so that both sides can use it.

use std::cell::Cell;

thread_local! {
    static SERVING_THREAD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Marks the calling thread as serving thread `index`.
pub fn enter(index: usize) {
    SERVING_THREAD.set(Some(index));
}

/// The index of the serving thread the caller runs on; `None` on any other thread.
pub fn thread() -> Option<usize> {
    SERVING_THREAD.get()
}
