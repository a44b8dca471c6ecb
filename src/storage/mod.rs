//! The storage seam: local files and objects (`s3://`, `gs://`, `az://`) behind one small API.
//!
//! A location is a path everywhere in ckpt: a remote one is the URL itself
//! (`s3://bucket/prefix/__0_0.distcp`), so readers join names onto it as onto a directory and
//! errors name it as they name a file. [`parse_location`] (the CLI's parser for every path
//! argument) checks a URL's form once; the store behind a bucket is built from the environment
//! on first use ([`remote`]).
//!
//! Readers ask for what they need and no more: [`stat`], [`list`], [`read`] for small whole
//! files, and an [`Input`] for random access. A local input is memory-mapped as before; a remote
//! one is read with ranged GETs through a bounded block cache, and a ZIP archive inside it (a
//! torch.save file, a DCP item) is seen through [`Input::zip_view`]: an image of the archive in
//! which only its framing (end records, central directory, local headers, descriptors) and small
//! records (`data.pkl`) are fetched, the tensor bytes left unread.

mod gcs;
mod multipart;
mod remote;

use std::fs::File;
use std::ops::Deref;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};

/// A store whose multipart calls each take a round trip, for the tests of their callers.
#[cfg(test)]
pub(crate) use multipart::tests::ranks as slow_uploads;
pub(crate) use multipart::{
    abort_uploads, complete_uploads, create_uploads, PendingPart, UploadedPart,
};
pub(crate) use remote::{
    fetch_each, fetch_window, gets_of, Remote, BLOCK_BYTES, GETS_IN_FLIGHT, GET_BYTES,
};

/// Largest buffer [`Input::copy_to`] reads through where the kernel will not copy.
const COPY_FALLBACK_BYTES: u64 = 8 << 20;

/// URL schemes ckpt reads and writes, served by the same object_store code.
pub(crate) const SCHEMES: [&str; 3] = ["s3", "gs", "az"];

/// Parse a path argument: a local path as it is, or an object store URL checked for its form
/// (scheme, bucket, a key without empty, `.` or `..` segments). For clap's `value_parser`, so a
/// bad URL is a usage error (exit 2) before any work.
pub(crate) fn parse_location(arg: &str) -> std::result::Result<PathBuf, String> {
    let Some((scheme, rest)) = arg.split_once("://") else {
        return Ok(PathBuf::from(arg));
    };
    if !SCHEMES.contains(&scheme) {
        return Err(format!(
            "`{arg}`: ckpt reads and writes s3://, gs:// and az:// URLs, and local paths"
        ));
    }
    let rest = rest.trim_end_matches('/');
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() || bucket.contains(|c: char| c.is_whitespace() || c == '?' || c == '#') {
        return Err(format!(
            "`{arg}`: no usable bucket name after `{scheme}://`"
        ));
    }
    if !key.is_empty()
        && key
            .split('/')
            .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(format!(
            "`{arg}`: an object key may not have empty, `.` or `..` parts"
        ));
    }
    Ok(PathBuf::from(format!("{scheme}://{rest}")))
}

/// True when `path` names an object store location rather than a local path.
pub(crate) fn is_remote(path: &Path) -> bool {
    split_url(path).is_some()
}

/// `(scheme, bucket, key)` of a remote location.
fn split_url(path: &Path) -> Option<(&str, &str, &str)> {
    let s = path.to_str()?;
    let (scheme, rest) = s.split_once("://")?;
    if !SCHEMES.contains(&scheme) {
        return None;
    }
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    Some((scheme, bucket, key.trim_end_matches('/')))
}

/// The store and key of a remote location, `None` for a local path.
pub(crate) fn remote(path: &Path) -> Option<Result<Remote>> {
    let (scheme, bucket, key) = split_url(path)?;
    Some(Remote::new(scheme, bucket, key, path))
}

/// What is at a location.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    File(u64),
    Dir,
}

/// What [`look`] found at a path.
pub(crate) enum Look {
    /// A directory (a prefix with objects below it) and its entries.
    Dir(Vec<Entry>),
    /// A file (an object) of this many bytes.
    File(u64),
}

/// What is at `path`, listed once: a directory's entries, or the file; nothing there is a usage
/// error naming it.
pub(crate) fn look(path: &Path) -> Result<Look> {
    // In an object store a directory is a prefix: one LIST tells it and lists it, where a HEAD
    // (is it an object?) and a LIST (is anything below it?) would come first.
    if is_remote(path) {
        let entries = listing(path)?;
        if !entries.is_empty() {
            return Ok(Look::Dir(entries));
        }
    }
    match stat(path)? {
        Some(Stat::File(len)) => Ok(Look::File(len)),
        Some(Stat::Dir) => Ok(Look::Dir(listing(path)?)),
        None if is_remote(path) => {
            let hint = "no object has this key and none lies under it: check the key (keys are \
                        case-sensitive) against a listing of the bucket";
            Err(Error::usage(format!("`{}` does not exist", path.display())).hint(hint))
        }
        None => Err(Error::usage(format!("`{}` does not exist", path.display()))),
    }
}

/// `path` made absolute: a local path against the working directory, an object store URL as
/// it is. What names an input for good (a partitioned run's fingerprint).
pub(crate) fn absolute(path: &Path) -> PathBuf {
    if is_remote(path) {
        return path.to_path_buf();
    }
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Write a small file (a manifest) whole: a local one under a temporary name, then renamed into
/// place; an object with one PUT, which an object store makes visible whole.
pub(crate) fn write_small(path: &Path, bytes: Vec<u8>) -> Result<()> {
    if let Some(r) = remote(path) {
        return r?.put(bytes);
    }
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("manifest");
    let tmp = path.with_file_name(format!(".{name}.ckpt-tmp-{}", std::process::id()));
    // `create_new` never follows a symlink planted under the temporary name.
    let _ = std::fs::remove_file(&tmp);
    let result = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| {
            std::io::Write::write_all(&mut f, &bytes)?;
            f.sync_all()
        })
        .and_then(|_| std::fs::rename(&tmp, path));
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// The permission bits of the local file at `path`; `None` for an object, which has none.
pub(crate) fn mode(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    match remote(path) {
        Some(_) => None,
        None => std::fs::metadata(path).ok().map(|m| m.permissions().mode()),
    }
}

/// What is at `path`: a file (object) and its length, a directory (a prefix with objects below
/// it), or nothing. Errors other than "not found" (credentials, a missing bucket, a refused
/// connection) are errors.
pub(crate) fn stat(path: &Path) -> Result<Option<Stat>> {
    match remote(path) {
        Some(r) => r?.stat(),
        None => Ok(std::fs::metadata(path).ok().map(|m| {
            if m.is_dir() {
                Stat::Dir
            } else {
                Stat::File(m.len())
            }
        })),
    }
}

/// True when `path` is a file; false when it is anything else or cannot be read.
pub(crate) fn is_file(path: &Path) -> bool {
    matches!(stat(path), Ok(Some(Stat::File(_))))
}

/// True when `path` is a directory; false when it is anything else or cannot be read.
pub(crate) fn is_dir(path: &Path) -> bool {
    matches!(stat(path), Ok(Some(Stat::Dir)))
}

/// The entries of directory `dir` (files and directories one level down), sorted.
pub(crate) fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(listing(dir)?.into_iter().map(|e| e.path).collect())
}

/// One entry of a directory: its path and what it is (a file's length included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub path: PathBuf,
    pub stat: Stat,
}

impl Entry {
    /// The last component of the path, as text (empty when it is not UTF-8).
    pub fn name(&self) -> &str {
        self.path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
    }

    pub fn is_file(&self) -> bool {
        matches!(self.stat, Stat::File(_))
    }

    pub fn is_dir(&self) -> bool {
        self.stat == Stat::Dir
    }
}

/// The entries of directory `dir`, sorted by path, each with its kind and length: one LIST for a
/// remote directory, after which opening a listed object sends no HEAD. A local entry that
/// cannot be stat'ed (a dangling link) is left out, as it cannot be read either.
pub(crate) fn listing(dir: &Path) -> Result<Vec<Entry>> {
    let mut out: Vec<Entry> = match remote(dir) {
        Some(r) => r?
            .list()?
            .into_iter()
            .map(|(path, stat)| Entry { path, stat })
            .collect(),
        None => std::fs::read_dir(dir)
            .map_err(|e| Error::io(dir, e))?
            .flatten()
            .filter_map(|e| {
                let path = e.path();
                let meta = std::fs::metadata(&path).ok()?;
                let stat = if meta.is_dir() {
                    Stat::Dir
                } else {
                    Stat::File(meta.len())
                };
                Some(Entry { path, stat })
            })
            .collect(),
    };
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

/// The whole of a small file (an index, a manifest, a `.metadata`).
pub(crate) fn read(path: &Path) -> Result<Vec<u8>> {
    match remote(path) {
        Some(r) => r?.read_all(),
        None => std::fs::read(path).map_err(|e| Error::io(path, e)),
    }
}

/// Map `file` read-only.
///
/// # Safety
/// The caller must not write `file` while the map lives. ckpt never writes its inputs (the output
/// module refuses outputs that are or lie inside one); a file truncated by another process while
/// mapped would fault, which is why the executor re-checks input sizes at the end and `--io read`
/// exists for filesystems where that is a risk.
unsafe fn map(file: &File, populate: bool) -> std::io::Result<Mmap> {
    let mut options = memmap2::MmapOptions::new();
    if populate {
        options.populate();
    }
    // SAFETY: the caller's contract above.
    unsafe { options.map(file) }
}

/// How a local input is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Memory-mapped; pages fault in as they are read.
    Map,
    /// Memory-mapped with every page read up front (files whose framing is on every page).
    MapPopulated,
    /// Positional reads (`--io read`, for network filesystems where page faults are slow).
    Read,
}

/// An input file (local) or object (remote), opened once for random access.
pub struct Input {
    path: PathBuf,
    len: u64,
    inner: Inner,
}

enum Inner {
    Local { file: File, map: Option<Mmap> },
    Remote(remote::OpenObject),
}

impl Input {
    pub fn open(path: &Path, access: Access) -> Result<Input> {
        if let Some(r) = remote(path) {
            let object = r?.open()?;
            return Ok(Input {
                path: path.to_path_buf(),
                len: object.len(),
                inner: Inner::Remote(object),
            });
        }
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let map = if access != Access::Read && len > 0 {
            // SAFETY: ckpt never writes an input; see `map`.
            Some(
                unsafe { map(&file, access == Access::MapPopulated) }
                    .map_err(|e| Error::io(path, e))?,
            )
        } else {
            None
        };
        Ok(Input {
            path: path.to_path_buf(),
            len,
            inner: Inner::Local { file, map },
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether each read of this input is a request with a round trip of its own (a ranged GET
    /// of an object), rather than a read of a file the kernel holds: callers then fetch ahead,
    /// batch and order their reads, and cannot hand byte ranges to the kernel to copy.
    pub fn reads_by_request(&self) -> bool {
        matches!(self.inner, Inner::Remote(_))
    }

    /// The mapped bytes of a local input.
    pub fn map(&self) -> Option<&[u8]> {
        match &self.inner {
            Inner::Local { map, .. } => map.as_deref(),
            Inner::Remote(_) => None,
        }
    }

    /// The open file of a local input (for `copy_file_range`).
    pub fn file(&self) -> Option<&File> {
        match &self.inner {
            Inner::Local { file, .. } => Some(file),
            Inner::Remote(_) => None,
        }
    }

    pub(crate) fn object(&self) -> Option<&remote::OpenObject> {
        match &self.inner {
            Inner::Remote(o) => Some(o),
            Inner::Local { .. } => None,
        }
    }

    /// Copy `len` bytes from `src_offset` into `out` at `dest_offset` with `copy_file_range(2)`
    /// in a loop (the kernel copies page-cache pages, or shares extents where the filesystem
    /// can), falling back to read + write where the kernel refuses (other filesystems, old
    /// kernels). A local input only.
    pub(crate) fn copy_to(
        &self,
        mut src_offset: u64,
        out: &File,
        out_path: &Path,
        mut dest_offset: u64,
        len: u64,
    ) -> Result<()> {
        use std::os::fd::AsRawFd;
        let file_in = self
            .file()
            .ok_or_else(|| Error::bug("a kernel copy from an object").file(self.path()))?;
        let mut left = len;
        while left > 0 {
            let mut off_in = src_offset as libc::loff_t;
            let mut off_out = dest_offset as libc::loff_t;
            let chunk = left.min(1 << 30) as usize;
            // The system call itself, not glibc's wrapper (glibc 2.27 and later), so that the
            // binary runs on the glibc 2.17 of manylinux2014 (`scripts/wheel`); a kernel without
            // it (before 4.5) says ENOSYS, handled below, as Rust's std does.
            // SAFETY: both descriptors are open for the duration of the call and the offsets are
            // plain integers the kernel updates through the pointers to our two locals; no other
            // memory of ours is read or written.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_copy_file_range,
                    file_in.as_raw_fd(),
                    &mut off_in as *mut libc::loff_t,
                    out.as_raw_fd(),
                    &mut off_out as *mut libc::loff_t,
                    chunk,
                    0 as libc::c_uint,
                )
            };
            if n > 0 {
                src_offset += n as u64;
                dest_offset += n as u64;
                left -= n as u64;
                continue;
            }
            if n == 0 {
                return Err(
                    Error::invalid("file ended early: did it change during the run?")
                        .file(self.path())
                        .at(src_offset),
                );
            }
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EXDEV | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL) => {
                    let mut buf = vec![0u8; left.min(COPY_FALLBACK_BYTES) as usize];
                    self.read_at(src_offset, &mut buf)?;
                    out.write_all_at(&buf, dest_offset)
                        .map_err(|e| Error::io(out_path, e).at(dest_offset))?;
                    src_offset += buf.len() as u64;
                    dest_offset += buf.len() as u64;
                    left -= buf.len() as u64;
                }
                _ => return Err(Error::io(out_path, err).at(dest_offset)),
            }
        }
        Ok(())
    }

    /// Fill `buf` from `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(buf.len() as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(Error::invalid("read past the end of the file")
                .file(&self.path)
                .at(offset));
        }
        match &self.inner {
            Inner::Local { map: Some(map), .. } => {
                let s = offset as usize;
                buf.copy_from_slice(&map[s..s + buf.len()]);
                Ok(())
            }
            Inner::Local { file, map: None } => file.read_exact_at(buf, offset).map_err(|e| {
                let e = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    Error::invalid("file ended early: did it change during the run?")
                } else {
                    Error::io(&self.path, e)
                };
                e.file(&self.path).at(offset)
            }),
            Inner::Remote(o) => o.read_at(offset, buf),
        }
    }

    /// `len` bytes from `offset`: borrowed from a map, else read.
    pub fn bytes(&self, offset: u64, len: u64) -> Result<View<'_>> {
        if let Some(map) = self.map() {
            let s = usize::try_from(offset).ok();
            return match s.and_then(|s| map.get(s..s.checked_add(usize::try_from(len).ok()?)?)) {
                Some(b) => Ok(View::Borrowed(b)),
                None => Err(Error::invalid("read past the end of the file")
                    .file(&self.path)
                    .at(offset)),
            };
        }
        let mut buf = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
        self.read_at(offset, &mut buf)?;
        Ok(View::Owned(buf))
    }

    /// The ZIP archive of `len` bytes at `offset`, for the ZIP reader: borrowed from a map, or
    /// (remote) an image holding its framing and small records, where the bytes of large
    /// records (tensor data) read as zeros. Nothing but framing may be read from such an image.
    pub fn zip_view(&self, offset: u64, len: u64) -> Result<View<'_>> {
        match &self.inner {
            Inner::Remote(o) => o.zip_image(offset, len).map(View::Image),
            Inner::Local { .. } => self.bytes(offset, len),
        }
    }

    /// The input's length now, to notice a file that changed during the run.
    pub fn current_len(&self) -> Result<u64> {
        match &self.inner {
            Inner::Local { .. } => std::fs::metadata(&self.path)
                .map(|m| m.len())
                .map_err(|e| Error::io(&self.path, e)),
            // An object cannot change under a reader: a new version is a new object, and
            // ranged GETs of the one opened are pinned to its ETag.
            Inner::Remote(o) => Ok(o.len()),
        }
    }
}

/// Bytes of an input: borrowed from a map, read into memory, or a sparse ZIP image.
pub enum View<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
    Image(Option<Mmap>),
    /// Bytes fetched ahead from object storage, shared with the GET they came in.
    Fetched(bytes::Bytes),
}

impl Deref for View<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            View::Borrowed(b) => b,
            View::Owned(v) => v,
            View::Image(m) => m.as_deref().unwrap_or(&[]),
            View::Fetched(b) => b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse() {
        assert_eq!(parse_location("a/b").unwrap(), PathBuf::from("a/b"));
        assert_eq!(
            parse_location("s3://bkt/x/y/").unwrap(),
            PathBuf::from("s3://bkt/x/y")
        );
        assert_eq!(
            parse_location("gs://bkt").unwrap(),
            PathBuf::from("gs://bkt")
        );
        assert!(parse_location("http://bkt/x").is_err());
        assert!(parse_location("s3:///x").is_err());
        assert!(parse_location("s3://bkt/a//b").is_err());
        assert!(parse_location("s3://bkt/a/../b").is_err());
        let p = parse_location("s3://bkt/ck").unwrap();
        assert_eq!(p.join(".metadata"), PathBuf::from("s3://bkt/ck/.metadata"));
        assert_eq!(split_url(&p), Some(("s3", "bkt", "ck")));
        assert!(!is_remote(Path::new("s3:/x")));
    }
}
