//! The crate's own source files, for the tests that read them (tests/layout.rs,
//! tests/error_chain.rs). It depends on nothing else in `support`, so those tests include
//! this file alone with `#[path]`.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, at any depth, added to `out`.
pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}
