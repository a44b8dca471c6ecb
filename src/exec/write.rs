//! Writing outputs: creating a destination at its length, literal runs with their CRCs, a block
//! from memory (through a pipe, which this VM copies far cheaper than `pwrite`), and writeback
//! started as the run goes (a range the kernel copies is the input's: `Input::copy_to`). Only
//! system calls on the output side; what to write comes from the plan in [`super`].

use std::cell::RefCell;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::plan::FilePlan;

/// Open (creating it if no other part has yet) a file that several parts of a run write, at its
/// full length. Setting the length it already has changes nothing another part wrote.
pub(super) fn open_shared_output(path: &Path, len: u64) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let have = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if have != len {
        file.set_len(len).map_err(|e| Error::io(path, e))?;
    }
    Ok(file)
}

pub(super) fn create_output(path: &Path, len: u64) -> Result<File> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    file.set_len(len).map_err(|e| Error::io(path, e))?;
    Ok(file)
}

/// Write a file's literal bytes (headers, framing) with the data's CRC-32s patched in.
///
/// Literals are written after the data so that the CRCs are known: adjacent literals (a torch.save
/// item's trailer and the next item's headers) go out as one write with the CRC slots inside them
/// filled in memory, instead of one small write per header and per slot. They arrive in offset
/// order from [`FilePlan::for_each_literal`], which renders DCP items one at a time, so memory is
/// one run of adjacent literals.
///
/// With `clip` (one part's share of the file), only the bytes inside it are written; the caller
/// patches only slots that lie wholly inside it.
pub(super) fn write_literals(
    out: &File,
    path: &Path,
    file: &FilePlan,
    crc_patches: &[(u64, [u8; 4])],
    clip: Option<Range<u64>>,
) -> Result<()> {
    let mut patches = crc_patches.to_vec();
    patches.sort_by_key(|(slot, _)| *slot);
    let mut w = LiteralWriter {
        out,
        path,
        patched: vec![false; patches.len()],
        patches,
        run: Vec::new(),
        run_start: 0,
        clip: clip.unwrap_or(0..u64::MAX),
    };
    file.for_each_literal(|offset, bytes| w.push(offset, bytes))?;
    w.flush()?;
    // A slot outside every literal (none in the layouts ckpt plans today) is written on its own,
    // after the literals so that no literal overwrites it.
    for ((slot, crc), done) in w.patches.iter().zip(&w.patched) {
        if !done {
            out.write_all_at(crc, *slot)
                .map_err(|e| Error::io(path, e).at(*slot))?;
        }
    }
    Ok(())
}

/// Gathers adjacent literals into one run and writes it, CRCs patched in, when the next literal
/// does not follow on.
struct LiteralWriter<'a> {
    out: &'a File,
    path: &'a Path,
    /// Sorted by slot.
    patches: Vec<(u64, [u8; 4])>,
    patched: Vec<bool>,
    run: Vec<u8>,
    run_start: u64,
    /// The bytes of the file this writer may write (a part's share; everything otherwise).
    clip: Range<u64>,
}

impl LiteralWriter<'_> {
    fn push(&mut self, offset: u64, bytes: &[u8]) -> Result<()> {
        let end = offset + bytes.len() as u64;
        if end <= self.clip.start || offset >= self.clip.end {
            return Ok(());
        }
        if !self.run.is_empty() && self.run_start + self.run.len() as u64 != offset {
            self.flush()?;
        }
        if self.run.is_empty() {
            self.run_start = offset;
        }
        self.run.extend_from_slice(bytes);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.run.is_empty() {
            return Ok(());
        }
        let (start, end) = (self.run_start, self.run_start + self.run.len() as u64);
        let first = self.patches.partition_point(|(slot, _)| *slot < start);
        for (k, (slot, crc)) in self.patches.iter().enumerate().skip(first) {
            if *slot + 4 > end {
                break;
            }
            let at = (*slot - start) as usize;
            self.run[at..at + 4].copy_from_slice(crc);
            self.patched[k] = true;
        }
        let (a, b) = (start.max(self.clip.start), end.min(self.clip.end));
        let bytes = &self.run[(a - start) as usize..(b - start) as usize];
        self.out
            .write_all_at(bytes, a)
            .map_err(|e| Error::io(self.path, e).at(a))?;
        self.run.clear();
        Ok(())
    }
}

/// Bytes a write pipe holds (`F_SETPIPE_SZ`; the default, 64 KiB, where that is refused).
const PIPE_BYTES: usize = 1 << 20;

/// This thread's pipe for [`write_at`]: read end, write end; `None` inside once it cannot be
/// used (no pipe, or a filesystem that refuses `splice`), so that every later write is a pwrite.
type WritePipe = Option<Option<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)>>;

thread_local! {
    static PIPE: RefCell<WritePipe> = const { RefCell::new(None) };
}

/// Write `buf` to `out` at `offset`.
///
/// Through a pipe where the kernel allows it: `vmsplice` lends the buffer's pages to a pipe and
/// `splice` copies them into the file's page cache, as `copy_file_range` copies between files.
/// On this project's VM a `pwrite` of the same bytes from user memory (the kernel's
/// `copy_folio_from_iter_atomic`) cost 3 to 9 times as much CPU for 0.55 GB (0.50-1.46 s against
/// 0.14-0.15 s), which made every computed or cast byte far dearer than a copied one. The pipe is
/// drained before returning, so the buffer is the caller's again; any failure falls back to
/// `pwrite` for the rest.
pub(super) fn write_at(out: &File, path: &Path, buf: &[u8], offset: u64) -> Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let written = PIPE.with(|cell| {
        let mut cell = cell.borrow_mut();
        let pipe = cell.get_or_insert_with(|| {
            let mut fds = [0; 2];
            // SAFETY: `fds` is an array of two descriptors for the kernel to fill.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return None;
            }
            // SAFETY: pipe2 succeeded, so both are open descriptors that nothing else owns.
            let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            // SAFETY: a plain fcntl on a descriptor we own; a refusal leaves the default size.
            unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_BYTES as libc::c_int) };
            Some((r, w))
        });
        let Some((r, w)) = pipe.as_ref() else {
            return 0;
        };
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &buf[done..];
            let iov = libc::iovec {
                iov_base: rest.as_ptr() as *mut libc::c_void,
                iov_len: rest.len().min(PIPE_BYTES),
            };
            // SAFETY: `iov` describes initialized memory of `buf`, which outlives the call and
            // is not written while the pipe holds its pages: they are spliced out below before
            // this function returns, or the pipe is closed (dropping them) on failure.
            let lent = unsafe { libc::vmsplice(w.as_raw_fd(), &iov, 1, 0) };
            if lent <= 0 {
                break;
            }
            let mut left = lent as usize;
            while left > 0 {
                let mut off = (offset + done as u64) as libc::loff_t;
                // SAFETY: plain descriptors we own and an offset the kernel updates; no memory
                // of ours is written.
                let n = unsafe {
                    libc::splice(
                        r.as_raw_fd(),
                        std::ptr::null_mut(),
                        out.as_raw_fd(),
                        &mut off,
                        left,
                        0,
                    )
                };
                if n <= 0 {
                    // The pipe may still hold pages of `buf`: closed now, and not used again.
                    *pipe = None;
                    return done;
                }
                left -= n as usize;
                done += n as usize;
            }
        }
        done
    });
    let at = offset + written as u64;
    out.write_all_at(&buf[written..], at)
        .map_err(|e| Error::io(path, e).at(at))
}

/// Ask the kernel to start writing `file`'s dirty pages to disk, without waiting.
///
/// Without this, every dirty page of a multi-gigabyte output is still in memory when the final
/// fsync starts, and the run waits for all of it at the end; started every [`super::WRITEBACK_BYTES`], the
/// disk works while later blocks are copied and the fsync finds little left. Pages already being
/// written are skipped. Only a hint: errors are reported by the fsync.
pub(super) fn start_writeback(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain syscall on a descriptor we own; no memory of ours is involved. Offset 0 and
    // length 0 mean the whole file.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
    }
}
