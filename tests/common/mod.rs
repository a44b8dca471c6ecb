//! What the integration test binaries share: the fixtures directory and a per-test temporary
//! directory. Each binary uses a different part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A temporary directory for one test, removed at the end.
pub struct TestEnv {
    dir: tempfile::TempDir,
}

impl TestEnv {
    pub fn new() -> TestEnv {
        TestEnv {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.path(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&path, bytes).unwrap();
        path
    }

    /// Copy a fixture (file or directory) into the temp dir, to damage it safely.
    pub fn copy_fixture(&self, name: &str) -> PathBuf {
        let dst = self.path(name);
        copy_tree(&fixtures().join(name), &dst);
        dst
    }

    /// Every path under the temp dir with its kind and length: what "nothing changed" compares.
    pub fn snapshot(&self) -> BTreeMap<PathBuf, (bool, u64)> {
        let mut out = BTreeMap::new();
        walk(self.root(), &mut out);
        out
    }
}

fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, (bool, u64)>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let meta = std::fs::symlink_metadata(&p).unwrap();
        out.insert(p.clone(), (meta.is_dir(), meta.len()));
        if meta.is_dir() {
            walk(&p, out);
        }
    }
}

pub fn copy_tree(src: &Path, dst: &Path) {
    if src.is_dir() {
        std::fs::create_dir_all(dst).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            copy_tree(&e.path(), &dst.join(e.file_name()));
        }
    } else {
        std::fs::copy(src, dst).unwrap();
    }
}
