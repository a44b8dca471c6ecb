//! Objects behind object_store: stores built from the environment, one tokio runtime, ranged
//! GETs through a bounded block cache, and sparse images of ZIP archives (holding the bytes
//! [`crate::zip::framing`] names).
//!
//! object_store is async; ckpt's workers are rayon threads. Each blocking call runs its future
//! on the calling thread with [`block_on`], while the runtime's two threads drive the sockets,
//! so every worker has its own requests in flight and no worker waits for another's.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{StreamExt, TryStreamExt};
use memmap2::Mmap;
use object_store::multipart::MultipartStore;
use object_store::path::Path as Key;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreExt, RetryConfig};

use crate::error::{Error, ErrorKind, Result};

/// Size of a cached block: small reads (headers, ZIP framing, small tensors) fetch whole blocks,
/// so the framing of neighbouring DCP items and neighbouring small pieces come in one GET. GETs,
/// not bytes, are what costs: a request has a latency of its own, and some servers read the whole
/// object for each ranged GET.
pub(crate) const BLOCK_BYTES: u64 = 4 << 20;
/// Bytes of blocks kept, over all objects (least recently used dropped first).
pub(crate) const CACHE_BYTES: u64 = 64 << 20;
/// Blocks of the cache shared by the objects being read (three quarters of it; the rest holds
/// framing the readers come back to).
const SHARED_BLOCKS: u64 = CACHE_BYTES / BLOCK_BYTES * 3 / 4;
/// Fetches remembered to tell how many objects are being read at once.
const RECENT: usize = 1024;
/// Least read ahead of a small read when the cache is crowded: a consolidation from 512 ranks
/// holds 128 MiB read ahead.
const MIN_AHEAD: u64 = 256 << 10;
/// Sequential readers of one object followed at once.
const STREAMS: usize = 8;
/// Most blocks read ahead of a sequential reader, in one GET with the block it missed.
const READ_AHEAD: u64 = 3;
/// GETs one thread keeps in flight at once.
const IN_FLIGHT: usize = 8;

/// A bucket's store, built once per bucket from the environment.
pub(crate) struct Store {
    pub(crate) name: String,
    pub(crate) objects: Arc<dyn ObjectStore>,
    pub(crate) multipart: Arc<dyn MultipartStore>,
    /// Each part of a multipart upload is an object of its own until the upload completes or is
    /// aborted (GCS, see [`super::gcs`]): one stored after the abort would stay.
    pub(crate) parts_are_objects: bool,
}

/// A remote location: a bucket's store and a key in it.
#[derive(Clone)]
pub(crate) struct Remote {
    pub(crate) store: Arc<Store>,
    pub(crate) key: Key,
    pub(crate) path: PathBuf,
}

pub(crate) fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<std::result::Result<tokio::runtime::Runtime, String>> =
        OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("ckpt-io")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::new(ErrorKind::Io, format!("cannot start the I/O runtime: {e}")))
}

/// Run `fut` to completion on this thread, the runtime driving its I/O.
pub(crate) fn block_on<F: std::future::Future>(fut: F) -> Result<F::Output> {
    Ok(runtime()?.block_on(fut))
}

/// Retries of a failed request (throttling, 5xx, dropped connections), as the AWS SDKs do
/// (3 to 5 attempts): a store's throttling clears within seconds, and a run that still fails
/// then says so instead of waiting for minutes.
const RETRIES: usize = 5;

/// How often and how long a request is retried, with exponential backoff (from 0.1 s, each wait
/// drawn up to twice the last: about 3 s over the 5 retries; `retry_timeout` bounds slow
/// requests); then the error names the object and the status.
fn retry() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
            base: 2.0,
        },
        max_retries: RETRIES,
        retry_timeout: Duration::from_secs(60),
    }
}

fn build(scheme: &str, bucket: &str) -> std::result::Result<Store, object_store::Error> {
    fn both<T: ObjectStore + MultipartStore>(
        s: T,
    ) -> (Arc<dyn ObjectStore>, Arc<dyn MultipartStore>) {
        let s = Arc::new(s);
        (s.clone(), s)
    }
    let (objects, multipart) = match scheme {
        "s3" => both(
            object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry())
                .build()?,
        ),
        "gs" => both(super::gcs::build(bucket, retry())?),
        _ => both(
            object_store::azure::MicrosoftAzureBuilder::from_env()
                .with_container_name(bucket)
                .with_retry(retry())
                .build()?,
        ),
    };
    Ok(Store {
        name: format!("{scheme}://{bucket}"),
        objects,
        multipart,
        parts_are_objects: scheme == "gs",
    })
}

impl Remote {
    pub(crate) fn new(scheme: &str, bucket: &str, key: &str, path: &Path) -> Result<Remote> {
        static STORES: OnceLock<Mutex<HashMap<String, Arc<Store>>>> = OnceLock::new();
        let name = format!("{scheme}://{bucket}");
        let mut stores = STORES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let store = match stores.get(&name) {
            Some(s) => s.clone(),
            None => {
                let s = Arc::new(build(scheme, bucket).map_err(|e| {
                    Error::usage(format!("cannot use `{name}`: {e}")).hint(vars(scheme).setup)
                })?);
                stores.insert(name, s.clone());
                s
            }
        };
        let key =
            Key::parse(key).map_err(|e| Error::usage(format!("`{}`: {e}", path.display())))?;
        Ok(Remote {
            store,
            key,
            path: path.to_path_buf(),
        })
    }

    /// The location of `key` in the same store.
    pub(crate) fn path_of(&self, key: &Key) -> PathBuf {
        PathBuf::from(format!("{}/{}", self.store.name, key))
    }

    pub(crate) fn stat(&self) -> Result<Option<super::Stat>> {
        if let Some((size, _)) = listed_objects().get(&self.path) {
            return Ok(Some(super::Stat::File(*size)));
        }
        if !self.key.as_ref().is_empty() {
            match block_on(self.store.objects.head(&self.key))? {
                Ok(meta) => return Ok(Some(super::Stat::File(meta.size))),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store_error(&self.path, e)),
            }
        }
        let listed = block_on(async {
            let prefix = Some(&self.key).filter(|k| !k.as_ref().is_empty());
            let mut objects = self.store.objects.list(prefix);
            objects.next().await.transpose()
        })?;
        match listed {
            Ok(Some(_)) => Ok(Some(super::Stat::Dir)),
            Ok(None) => Ok(None),
            Err(e) => Err(store_error(&self.path, e)),
        }
    }

    /// The objects and prefixes one level below this location, with each object's length. What
    /// the listing says of an object is remembered, so opening it next sends no HEAD (a 512-rank
    /// directory is one LIST, not 512 HEADs as well).
    pub(crate) fn list(&self) -> Result<Vec<(PathBuf, super::Stat)>> {
        let prefix = Some(&self.key).filter(|k| !k.as_ref().is_empty());
        let listed = block_on(self.store.objects.list_with_delimiter(prefix))?
            .map_err(|e| store_error(&self.path, e))?;
        let mut seen = listed_objects();
        let mut out = Vec::with_capacity(listed.objects.len() + listed.common_prefixes.len());
        for o in &listed.objects {
            let path = self.path_of(&o.location);
            seen.insert(path.clone(), (o.size, o.e_tag.clone()));
            out.push((path, super::Stat::File(o.size)));
        }
        out.extend(
            listed
                .common_prefixes
                .iter()
                .map(|p| (self.path_of(p), super::Stat::Dir)),
        );
        Ok(out)
    }

    /// Every key under this location taken as a directory (`key/...`).
    pub(crate) fn list_below(&self) -> Result<Vec<Key>> {
        let prefix = Some(&self.key).filter(|k| !k.as_ref().is_empty());
        block_on(
            self.store
                .objects
                .list(prefix)
                .map_ok(|m| m.location)
                .try_collect(),
        )?
        .map_err(|e| store_error(&self.path, e))
    }

    /// Store `bytes` as the object in one PUT: it appears whole or not at all.
    pub(crate) fn put(&self, bytes: Vec<u8>) -> Result<()> {
        block_on(self.put_async(bytes))?
    }

    /// [`Remote::put`] as a future, for many at once.
    pub(crate) async fn put_async(&self, bytes: Vec<u8>) -> Result<()> {
        listed_objects().remove(&self.path);
        self.store
            .objects
            .put(&self.key, object_store::PutPayload::from(bytes))
            .await
            .map(|_| ())
            .map_err(|e| store_error(&self.path, e))
    }

    /// The whole object.
    pub(crate) fn read_all(&self) -> Result<Vec<u8>> {
        let got = block_on(async {
            let r = self.store.objects.get(&self.key).await?;
            r.bytes().await
        })?;
        got.map(|b| b.to_vec())
            .map_err(|e| store_error(&self.path, e))
    }

    pub(crate) fn open(self) -> Result<OpenObject> {
        // The cache knows an object by its location, length and ETag: the executor opens again
        // what the reader opened, and finds the blocks the reader fetched.
        static IDS: OnceLock<Mutex<HashMap<ObjectVersion, u64>>> = OnceLock::new();
        let (size, e_tag) = match listed_objects().get(&self.path).cloned() {
            Some(known) => known,
            None => {
                let meta = block_on(self.store.objects.head(&self.key))?
                    .map_err(|e| store_error(&self.path, e))?;
                (meta.size, meta.e_tag)
            }
        };
        let id = {
            let mut ids = IDS
                .get_or_init(Default::default)
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let next = ids.len() as u64;
            *ids.entry((self.path.clone(), size, e_tag)).or_insert(next)
        };
        Ok(OpenObject {
            id,
            len: size,
            at: self,
            streams: Mutex::default(),
            ahead: Mutex::new(Windows {
                size: 0,
                held: VecDeque::new(),
            }),
        })
    }
}

/// An object as the block cache knows it: location, length and ETag.
type ObjectVersion = (PathBuf, u64, Option<String>);

/// Length and ETag of objects, by location.
type Listed = HashMap<PathBuf, (u64, Option<String>)>;

/// Length and ETag of every object a listing has shown, by location: what [`Remote::open`] would
/// otherwise ask a HEAD for.
fn listed_objects() -> std::sync::MutexGuard<'static, Listed> {
    static LISTED: OnceLock<Mutex<Listed>> = OnceLock::new();
    LISTED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// What the hints tell to check, in the environment variables object_store reads for a scheme.
struct Vars {
    /// How to configure the store at all.
    setup: &'static str,
    credentials: &'static str,
    endpoint: &'static str,
}

fn vars(scheme: &str) -> Vars {
    match scheme {
        "az" => Vars {
            setup: "set AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_KEY); \
                    AZURE_ENDPOINT for another endpoint, or AZURE_STORAGE_USE_EMULATOR=true and \
                    AZURITE_BLOB_STORAGE_URL for Azurite",
            credentials: "check AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or \
                          AZURE_STORAGE_SAS_KEY, or AZURE_CLIENT_ID, AZURE_CLIENT_SECRET and AZURE_TENANT_ID)",
            endpoint: "check AZURE_STORAGE_ACCOUNT_NAME and AZURE_ENDPOINT (AZURITE_BLOB_STORAGE_URL \
                       for Azurite) and that the store is reachable",
        },
        "gs" => Vars {
            setup: "set GOOGLE_SERVICE_ACCOUNT (a service account's JSON file) or \
                    GOOGLE_APPLICATION_CREDENTIALS; STORAGE_EMULATOR_HOST for an emulator",
            credentials: "check GOOGLE_SERVICE_ACCOUNT, GOOGLE_SERVICE_ACCOUNT_KEY or \
                          GOOGLE_APPLICATION_CREDENTIALS",
            endpoint: "check STORAGE_EMULATOR_HOST or GOOGLE_BASE_URL (if set) and that the store \
                       is reachable",
        },
        _ => Vars {
            setup: "set AWS_REGION, AWS_ENDPOINT_URL (and AWS_ALLOW_HTTP=true for http://) and \
                    credentials as for the AWS CLI",
            credentials: "check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN (or \
                          the profile's credentials)",
            endpoint: "check AWS_ENDPOINT_URL and that the store is reachable",
        },
    }
}

/// The error for a failed request: the object, and what the store said (status and code).
pub(crate) fn store_error(path: &Path, e: object_store::Error) -> Error {
    let not_found = matches!(e, object_store::Error::NotFound { .. });
    // Azure's error text goes on over lines (`RequestId:...`, `Time:...`): one line, as S3's.
    let text = condense_xml(&e.to_string())
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let url = path.to_string_lossy();
    let vars = vars(url.split_once("://").map_or("s3", |(scheme, _)| scheme));
    let err = Error::new(ErrorKind::Io, format!("object store: {text}")).file(path);
    // Azure answers 404 for a missing container: before "nothing is stored there".
    if text.contains("ContainerNotFound") {
        return err.hint("the container does not exist: create it, or check the URL");
    }
    // S3 and GCS's XML API say `NoSuchBucket`, GCS's JSON API "The specified bucket does not
    // exist." (a 404, so before "nothing is stored there").
    if text.contains("NoSuchBucket") || text.contains("bucket does not exist") {
        return err.hint("the bucket does not exist: create it, or check the URL");
    }
    if not_found {
        return err.hint("check the bucket and key: nothing is stored there");
    }
    if is_throttled(&text) {
        return err.hint(format!(
            "the store throttled the requests (each retried up to {RETRIES} times with backoff): \
             lower --threads, or retry later"
        ));
    }
    // Status codes with their reason, so that a port or a size in the text cannot match.
    if [
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "403 Forbidden",
    ]
    .iter()
    .any(|s| text.contains(s))
    {
        return err.hint(vars.credentials);
    }
    if text.contains("onnect") || text.contains("error sending request") {
        return err.hint(vars.endpoint);
    }
    err
}

/// Whether the store's reply was throttling: S3's `SlowDown` (HTTP 503), HTTP 429 (GCS, Azure
/// and other S3-compatible stores), or a 503 without a code.
fn is_throttled(text: &str) -> bool {
    [
        "SlowDown",
        "Please reduce your request rate",
        "503 Service Unavailable",
        "429 Too Many Requests",
        "TooManyRequests",
        "ServerBusy",
    ]
    .iter()
    .any(|s| text.contains(s))
}

/// The store's XML error body (`<Error><Code>C</Code><Message>M</Message>...</Error>`) as
/// `C: M` on the error's one line; any other text unchanged.
fn condense_xml(text: &str) -> String {
    let inner = |tag: &str, body: &str| -> Option<String> {
        let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
        let start = body.find(&open)? + open.len();
        let end = start + body[start..].find(&close)?;
        Some(body[start..end].trim().to_string())
    };
    let (Some(start), Some(end)) = (text.find("<Error>"), text.find("</Error>")) else {
        return text.to_string();
    };
    if end < start {
        return text.to_string();
    }
    let body = &text[start..end];
    let Some(code) = inner("Code", body) else {
        return text.to_string();
    };
    let said = match inner("Message", body) {
        Some(m) if !m.is_empty() => format!("{code}: {m}"),
        _ => code,
    };
    // An XML declaration before the body goes with it.
    let from = text[..start].rfind("<?xml").unwrap_or(start);
    let rest = &text[end + "</Error>".len()..];
    format!("{}{said}{}", &text[..from], rest.trim_end())
}

/// An object opened for ranged reads.
pub(crate) struct OpenObject {
    id: u64,
    len: u64,
    at: Remote,
    /// The sequential readers of this object (several threads may each go through a part of it):
    /// where each one's last fetched run ended and how many blocks it read ahead.
    streams: Mutex<Vec<Stream>>,
    /// When the cache is crowded ([`OpenObject::crowded`]): this object's windows, aligned pieces
    /// of its share of the cache, the last few fetched (see [`OpenObject::read_ahead_of`]).
    ahead: Mutex<Windows>,
}

/// An object's windows when the cache is crowded: their size, and the last [`WINDOWS`] fetched
/// (window number, bytes), oldest first.
struct Windows {
    size: u64,
    held: VecDeque<(u64, Bytes)>,
}

/// Windows kept per object: a read may straddle two, and workers a unit apart each need theirs.
const WINDOWS: usize = 2;

/// A sequential reader of an object: the block after its last fetched run, and how many blocks
/// that run read ahead.
#[derive(Clone, Copy)]
struct Stream {
    end: u64,
    ahead: u64,
}

/// Blocks of objects, least recently used dropped first, at most [`CACHE_BYTES`] in all.
#[derive(Default)]
struct Cache {
    blocks: HashMap<(u64, u64), Bytes>,
    order: VecDeque<(u64, u64)>,
    bytes: u64,
    /// Blocks a thread is fetching; others wait on [`cache_fetched`] for them.
    fetching: HashSet<(u64, u64)>,
    /// The objects of the last [`RECENT`] fetches: how many objects are being read at once,
    /// which the cache is shared by.
    recent: VecDeque<u64>,
    /// How many of `recent` each object is.
    readers: HashMap<u64, usize>,
}

/// Marks blocks of an object as being fetched while alive; on drop (fetched, or the fetch failed)
/// unmarks them and wakes the threads waiting for them.
struct Fetching<'a> {
    id: u64,
    blocks: &'a [u64],
}

impl Drop for Fetching<'_> {
    fn drop(&mut self) {
        let mut c = cache().lock().unwrap_or_else(|p| p.into_inner());
        for &b in self.blocks {
            c.fetching.remove(&(self.id, b));
        }
        drop(c);
        cache_fetched().notify_all();
    }
}

impl Cache {
    /// Remember a fetch from object `id` among the last [`RECENT`].
    fn fetched_from(&mut self, id: u64) {
        if self.recent.len() >= RECENT {
            if let Some(old) = self.recent.pop_front() {
                if let Some(n) = self.readers.get_mut(&old) {
                    *n -= 1;
                    if *n == 0 {
                        self.readers.remove(&old);
                    }
                }
            }
        }
        self.recent.push_back(id);
        *self.readers.entry(id).or_default() += 1;
    }

    /// Mark block `k` as just used: blocks are dropped least recently used first, so the blocks
    /// of a tensor whose units are still being gathered stay while older ones go.
    fn touch(&mut self, k: (u64, u64)) {
        if let Some(i) = self.order.iter().position(|x| *x == k) {
            self.order.remove(i);
        }
        self.order.push_back(k);
    }
}

fn cache() -> &'static Mutex<Cache> {
    static CACHE: OnceLock<Mutex<Cache>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Signalled when blocks being fetched are cached (or their fetch failed).
fn cache_fetched() -> &'static Condvar {
    static FETCHED: Condvar = Condvar::new();
    &FETCHED
}

thread_local! {
    /// The source ranges of the unit this thread is gathering: (object id, start, bytes).
    static WINDOW: RefCell<Vec<(u64, u64, Bytes)>> = const { RefCell::new(Vec::new()) };
}

/// Fetch `ranges` (object, byte range) for the unit about to be gathered on this thread,
/// coalesced and many in flight, replacing the previous unit's: reads inside them are then
/// served from memory. Memory: the ranges' bytes, about one unit.
pub(crate) fn fetch_window(ranges: &[(&OpenObject, Range<u64>)]) -> Result<()> {
    WINDOW.with(|w| w.borrow_mut().clear());
    if ranges.is_empty() {
        return Ok(());
    }
    let mut by_object: Vec<(&OpenObject, Vec<Range<u64>>)> = Vec::new();
    for (o, r) in ranges {
        match by_object.iter_mut().find(|(x, _)| x.id == o.id) {
            Some((_, rs)) => rs.push(r.clone()),
            None => by_object.push((o, vec![r.clone()])),
        }
    }
    let mut got = Vec::new();
    for (o, rs) in by_object {
        let rs = coalesce(rs);
        // Small ranges (small tensors, pieces of a few rows) through the block cache: the
        // neighbours a later unit needs come with them.
        if o.crowded() {
            for r in rs {
                let mut buf = vec![0u8; (r.end - r.start) as usize];
                o.read_at(r.start, &mut buf)?;
                got.push((o.id, r.start, Bytes::from(buf)));
            }
            continue;
        }
        let (small, large): (Vec<_>, Vec<_>) =
            rs.into_iter().partition(|r| r.end - r.start < BLOCK_BYTES);
        // The blocks are held here, not looked up again in the cache: other threads' fetches
        // may evict them in between, and a unit whose blocks were gone fetched them again.
        let blocks = o.blocks(&small)?;
        for r in small {
            let mut buf = vec![0u8; (r.end - r.start) as usize];
            o.copy_from(&blocks, r.start, &mut buf)?;
            got.push((o.id, r.start, Bytes::from(buf)));
        }
        let bytes = o.get_ranges(&large)?;
        got.extend(large.iter().zip(bytes).map(|(r, b)| (o.id, r.start, b)));
    }
    WINDOW.with(|w| *w.borrow_mut() = got);
    Ok(())
}

/// Most bytes one GET of [`gets_of`] asks for: an object of up to this size comes in one request,
/// as a download fetches it.
pub(crate) const GET_BYTES: u64 = 16 << 20;
/// GETs of [`fetch_each`] in flight at once, over all objects (boto3's transfer manager keeps 10).
pub(crate) const GETS_IN_FLIGHT: usize = 8;
/// Bytes between two needed ranges of an object that one GET reads across rather than splitting.
const GAP_BYTES: u64 = 64 << 10;

/// The GETs that fetch `ranges` (an input's number, a byte range of it) as a download would: by
/// input and offset, a range joins the GET before it when it is of the same input, starts at most
/// [`GAP_BYTES`] after that GET's end and keeps it within [`GET_BYTES`]. Each GET: its input, its
/// bytes, and the indices into `ranges` of the ranges inside it.
pub(crate) fn gets_of(ranges: &[(usize, Range<u64>)]) -> Vec<(usize, Range<u64>, Vec<usize>)> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&k| (ranges[k].0, ranges[k].1.start));
    let mut gets: Vec<(usize, Range<u64>, Vec<usize>)> = Vec::new();
    for k in order {
        let (input, r) = (ranges[k].0, &ranges[k].1);
        match gets.last_mut() {
            Some((i, get, ks))
                if *i == input
                    && r.start <= get.end + GAP_BYTES
                    && r.end.max(get.end) - get.start <= GET_BYTES =>
            {
                get.end = get.end.max(r.end);
                ks.push(k);
            }
            _ => gets.push((input, r.clone(), vec![k])),
        }
    }
    gets
}

/// Fetch each of `ranges` (object, byte range) in one GET, at most `in_flight` at a time across
/// objects, and hand each to `each` (its index in `ranges`, its bytes) on this thread as it
/// arrives, in whatever order they come. The bytes are not cached: each range is read once. An
/// error from `each` stops the run; the GETs still in flight are dropped.
pub(crate) fn fetch_each(
    ranges: &[(&OpenObject, Range<u64>)],
    in_flight: usize,
    mut each: impl FnMut(usize, Bytes) -> Result<()>,
) -> Result<()> {
    block_on(async {
        let gets = ranges.iter().enumerate().map(|(i, (o, r))| async move {
            let got =
                o.at.store
                    .objects
                    .get_range(&o.at.key, r.clone())
                    .await
                    .map_err(|e| store_error(&o.at.path, e))?;
            if got.len() as u64 != r.end - r.start {
                return Err(o.ended_early(r.start + got.len() as u64));
            }
            Ok((i, got))
        });
        let mut arriving = futures::stream::iter(gets).buffer_unordered(in_flight.max(1));
        while let Some(got) = arriving.next().await {
            let (i, bytes) = got?;
            each(i, bytes)?;
        }
        Ok(())
    })?
}

/// Sorted ranges with overlapping or adjacent ones (gaps under 64 KiB) merged.
fn coalesce(mut rs: Vec<Range<u64>>) -> Vec<Range<u64>> {
    rs.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(rs.len());
    for r in rs {
        match out.last_mut() {
            Some(last) if r.start <= last.end + (64 << 10) => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

impl OpenObject {
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Ranges fetched concurrently, at most [`IN_FLIGHT`] at a time, large ones in 16 MiB
    /// pieces so that they too come in parallel.
    fn get_ranges(&self, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        const PIECE: u64 = 16 << 20;
        if !ranges.is_empty() {
            let mut c = cache().lock().unwrap_or_else(|p| p.into_inner());
            c.fetched_from(self.id);
        }
        let mut pieces = Vec::new();
        for (i, r) in ranges.iter().enumerate() {
            let mut s = r.start;
            while s < r.end {
                let e = (s + PIECE).min(r.end);
                pieces.push((i, s..e));
                s = e;
            }
        }
        let store = &self.at.store.objects;
        let key = &self.at.key;
        let fetched: std::result::Result<Vec<Bytes>, object_store::Error> = block_on(async {
            futures::stream::iter(pieces.iter().map(|(_, r)| store.get_range(key, r.clone())))
                .buffered(IN_FLIGHT)
                .try_collect()
                .await
        })?;
        let fetched = fetched.map_err(|e| store_error(&self.at.path, e))?;
        let mut out: Vec<Vec<Bytes>> = vec![Vec::new(); ranges.len()];
        for ((i, _), b) in pieces.iter().zip(fetched) {
            out[*i].push(b);
        }
        Ok(out
            .into_iter()
            .map(|parts| match parts.len() {
                1 => parts.into_iter().next().unwrap_or_default(),
                _ => Bytes::from(parts.concat()),
            })
            .collect())
    }

    /// Make sure the blocks covering `ranges` are cached, fetching the missing ones at once.
    fn prefetch(&self, ranges: &[Range<u64>]) -> Result<()> {
        self.blocks(ranges).map(|_| ())
    }

    /// The blocks covering `ranges` (block number, bytes): cached ones taken from the cache
    /// (and marked used), missing ones fetched at once and cached. The caller holds what it got:
    /// a block other threads evict meanwhile stays readable to it and is not fetched again. A
    /// block another thread is fetching is waited for rather than fetched twice: workers going
    /// through an object together miss the same blocks at the same moment.
    fn blocks(&self, ranges: &[Range<u64>]) -> Result<HashMap<u64, Bytes>> {
        let mut have = HashMap::new();
        let mut missing = Vec::new();
        let mut awaited = Vec::new();
        {
            let mut c = cache().lock().unwrap_or_else(|p| p.into_inner());
            for r in ranges.iter().filter(|r| r.start < r.end) {
                for b in r.start / BLOCK_BYTES..=(r.end - 1) / BLOCK_BYTES {
                    if have.contains_key(&b) || missing.contains(&b) || awaited.contains(&b) {
                        continue;
                    }
                    if let Some(block) = c.blocks.get(&(self.id, b)).cloned() {
                        c.touch((self.id, b));
                        have.insert(b, block);
                    } else if c.fetching.contains(&(self.id, b)) {
                        awaited.push(b);
                    } else {
                        missing.push(b);
                    }
                }
            }
            missing.sort_unstable();
            // Runs of adjacent missing blocks, each one ranged GET (split by `get_ranges`).
            let mut runs: Vec<Range<u64>> = Vec::new();
            for &b in &missing {
                match runs.last_mut() {
                    Some(r) if r.end == b => r.end = b + 1,
                    _ => runs.push(b..b + 1),
                }
            }
            self.read_ahead(&mut runs, &c);
            missing = runs.iter().flat_map(Range::clone).collect();
            c.fetching.extend(missing.iter().map(|&b| (self.id, b)));
        }
        if !missing.is_empty() {
            // Marked as being fetched until this ends, fetched or not, so no thread waits forever.
            let _fetching = Fetching {
                id: self.id,
                blocks: &missing,
            };
            self.fetch_blocks(&missing, &mut have)?;
        }
        if !awaited.is_empty() {
            let mut c = cache().lock().unwrap_or_else(|p| p.into_inner());
            while awaited.iter().any(|&b| c.fetching.contains(&(self.id, b))) {
                c = cache_fetched().wait(c).unwrap_or_else(|p| p.into_inner());
            }
            let mut gone = Vec::new();
            for b in awaited {
                match c.blocks.get(&(self.id, b)).cloned() {
                    Some(block) => {
                        c.touch((self.id, b));
                        have.insert(b, block);
                    }
                    // Its fetch failed, or it was evicted already: fetched here.
                    None => gone.push(b),
                }
            }
            drop(c);
            if !gone.is_empty() {
                self.fetch_blocks(&gone, &mut have)?;
            }
        }
        Ok(have)
    }

    /// Fetch `blocks` (sorted) in runs of adjacent ones, one ranged GET each, into `have` and
    /// the cache.
    fn fetch_blocks(&self, blocks: &[u64], have: &mut HashMap<u64, Bytes>) -> Result<()> {
        let mut runs: Vec<Range<u64>> = Vec::new();
        for &b in blocks {
            match runs.last_mut() {
                Some(r) if r.end == b => r.end = b + 1,
                _ => runs.push(b..b + 1),
            }
        }
        let spans: Vec<Range<u64>> = runs
            .iter()
            .map(|r| r.start * BLOCK_BYTES..(r.end * BLOCK_BYTES).min(self.len))
            .collect();
        let got = self.get_ranges(&spans)?;
        let mut c = cache().lock().unwrap_or_else(|p| p.into_inner());
        for (run, bytes) in runs.into_iter().zip(got) {
            for b in run.clone() {
                let s = ((b - run.start) * BLOCK_BYTES) as usize;
                let e = (s + BLOCK_BYTES as usize).min(bytes.len());
                let block = bytes.slice(s.min(e)..e);
                have.insert(b, block.clone());
                c.bytes += block.len() as u64;
                if let Some(old) = c.blocks.insert((self.id, b), block) {
                    // Fetched by another thread meanwhile: counted once.
                    c.bytes -= old.len() as u64;
                }
                c.touch((self.id, b));
            }
        }
        while c.bytes > CACHE_BYTES {
            let Some(old) = c.order.pop_front() else {
                break;
            };
            if let Some(b) = c.blocks.remove(&old) {
                c.bytes -= b.len() as u64;
            }
        }
        Ok(())
    }

    /// How many objects are being read at once (of the last [`RECENT`] fetches), this one
    /// included.
    fn readers(&self, c: &Cache) -> u64 {
        let others = c.readers.len() - usize::from(c.readers.contains_key(&self.id));
        others as u64 + 1
    }

    /// True when more objects are being read at once than the cache has blocks to share
    /// between them: a consolidation from many ranks reads all their files in each work unit,
    /// and blocks fetched for one unit would be evicted by the time the next unit (the next
    /// tensor, a few bytes further in each file) needs them. Small reads then fetch just their
    /// bytes: as many GETs, a block's worth of bytes fewer each.
    fn crowded(&self) -> bool {
        let c = cache().lock().unwrap_or_else(|p| p.into_inner());
        self.readers(&c) > SHARED_BLOCKS
    }

    /// Extend the last run of missing blocks with blocks past it when the object is being read
    /// in order: a GET costs about the same for one block as for several (a request has a
    /// latency of its own, and some servers read the whole object for each), so a reader going
    /// through an object block by block is served by a few large GETs. A miss where a stream's
    /// last run ended continues that stream, whose read-ahead doubles up to [`READ_AHEAD`]
    /// blocks; any other miss starts a stream with none. Blocks cached or being fetched end the
    /// read-ahead.
    fn read_ahead(&self, runs: &mut [Range<u64>], c: &Cache) {
        let Some(last) = runs.last_mut() else {
            return;
        };
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        let ahead = match streams.iter().position(|s| s.end == last.start) {
            Some(i) => (streams.remove(i).ahead * 2).clamp(1, READ_AHEAD),
            None => 0,
        };
        // Half the cache is for blocks read ahead, shared by the objects being read: beyond that
        // they would be evicted before they are used (a consolidation from many ranks reads
        // all their files at once, and gets no read-ahead).
        let room = (SHARED_BLOCKS / self.readers(c)).saturating_sub(1);
        let ahead = ahead.min(room);
        let blocks = self.len.div_ceil(BLOCK_BYTES);
        last.end += (last.end..(last.end + ahead).min(blocks))
            .take_while(|b| {
                !c.blocks.contains_key(&(self.id, *b)) && !c.fetching.contains(&(self.id, *b))
            })
            .count() as u64;
        if streams.len() >= STREAMS {
            streams.remove(0);
        }
        streams.push(Stream {
            end: last.end,
            ahead,
        });
    }

    /// The error for bytes an object should have at `at` and does not.
    fn ended_early(&self, at: u64) -> Error {
        Error::invalid("object ended early: did it change during the run?")
            .file(&self.at.path)
            .at(at)
    }

    /// Fill `buf` from `offset` with ranged GETs of exactly those bytes.
    fn get_exact(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let range = offset..offset + buf.len() as u64;
        let got = self.get_ranges(std::slice::from_ref(&range))?;
        match got.first() {
            Some(b) if b.len() == buf.len() => {
                buf.copy_from_slice(b);
                Ok(())
            }
            _ => Err(self.ended_early(offset)),
        }
    }

    /// Copy the bytes at `offset` out of `blocks` (from [`OpenObject::blocks`]) into `buf`.
    fn copy_from(&self, blocks: &HashMap<u64, Bytes>, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut at = offset;
        let mut done = 0;
        while done < buf.len() {
            let b = at / BLOCK_BYTES;
            let s = (at - b * BLOCK_BYTES) as usize;
            let n = blocks
                .get(&b)
                .map_or(0, |block| block.len().saturating_sub(s))
                .min(buf.len() - done);
            if n == 0 {
                return Err(self.ended_early(at));
            }
            buf[done..done + n].copy_from_slice(&blocks[&b][s..s + n]);
            done += n;
            at += n as u64;
        }
        Ok(())
    }

    /// Fill `buf` from `offset` (the caller has checked the range): from this thread's window,
    /// through the block cache for small reads, else with ranged GETs.
    pub(crate) fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        let hit = WINDOW.with(|w| {
            let w = w.borrow();
            let Some((_, start, bytes)) = w
                .iter()
                .find(|(id, s, b)| *id == self.id && *s <= offset && end <= s + b.len() as u64)
            else {
                return false;
            };
            let s = (offset - start) as usize;
            buf.copy_from_slice(&bytes[s..s + buf.len()]);
            true
        });
        if hit || buf.is_empty() {
            return Ok(());
        }
        if buf.len() as u64 <= BLOCK_BYTES {
            if self.crowded() {
                // Blocks fetched before the cache was crowded (the reader's) still serve.
                if let Some(blocks) = self.cached(offset..end) {
                    return self.copy_from(&blocks, offset, buf);
                }
                return self.read_ahead_of(offset, buf);
            }
            let blocks = self.blocks(std::slice::from_ref(&(offset..end)))?;
            return self.copy_from(&blocks, offset, buf);
        }
        self.get_exact(offset, buf)
    }

    /// The cached blocks covering `range`, if every one is (marked used); nothing is fetched.
    fn cached(&self, range: Range<u64>) -> Option<HashMap<u64, Bytes>> {
        let mut c = cache().lock().unwrap_or_else(|p| p.into_inner());
        let mut have = HashMap::new();
        for b in range.start / BLOCK_BYTES..=(range.end.max(range.start + 1) - 1) / BLOCK_BYTES {
            let block = c.blocks.get(&(self.id, b)).cloned()?;
            c.touch((self.id, b));
            have.insert(b, block);
        }
        Some(have)
    }

    /// A small read when the cache is crowded: through this object's windows, aligned pieces
    /// of the object the size of its share of the cache ([`SHARED_BLOCKS`] blocks over the
    /// objects being read, at least [`MIN_AHEAD`]; fixed at its first such read). A reader going
    /// through the object in order fetches each window once, in one GET, and workers a unit
    /// apart find the windows the other fetched; a read larger than a window fetches just its
    /// bytes. The lock is held while fetching: workers reading the same object wait for one GET
    /// rather than send two.
    fn read_ahead_of(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset + buf.len() as u64;
        let mut w = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
        if w.size == 0 {
            let c = cache().lock().unwrap_or_else(|p| p.into_inner());
            w.size = (SHARED_BLOCKS * BLOCK_BYTES / self.readers(&c)).clamp(MIN_AHEAD, BLOCK_BYTES);
        }
        let size = w.size;
        if buf.len() as u64 > size {
            drop(w);
            return self.get_exact(offset, buf);
        }
        let wanted: Vec<u64> = (offset / size..=(end - 1) / size).collect();
        let missing: Vec<u64> = wanted
            .iter()
            .copied()
            .filter(|k| !w.held.iter().any(|(h, _)| h == k))
            .collect();
        if let (Some(&first), Some(&last)) = (missing.first(), missing.last()) {
            let span = first * size..((last + 1) * size).min(self.len);
            let got = self.get_ranges(std::slice::from_ref(&span))?;
            let got = got.into_iter().next().unwrap_or_default();
            for k in first..=last {
                let s = ((k - first) * size) as usize;
                let e = (s + size as usize).min(got.len());
                w.held.push_back((k, got.slice(s.min(e)..e)));
            }
            // The oldest go first, never one this read is about to copy from.
            while w.held.len() > WINDOWS.max(wanted.len()) {
                match w.held.iter().position(|(k, _)| !wanted.contains(k)) {
                    Some(i) => w.held.remove(i),
                    None => break,
                };
            }
        }
        let mut done = 0;
        for k in wanted {
            let piece = w.held.iter().find(|(h, _)| *h == k).map(|(_, b)| b);
            let s = (offset + done as u64 - k * size) as usize;
            let n = piece
                .map_or(0, |b| b.len().saturating_sub(s))
                .min(buf.len() - done);
            let Some(piece) = piece.filter(|_| n > 0) else {
                return Err(self.ended_early(offset + done as u64));
            };
            buf[done..done + n].copy_from_slice(&piece[s..s + n]);
            done += n;
        }
        Ok(())
    }

    /// Bytes of a ZIP archive's framing: through the block cache, or just them when the cache is
    /// crowded (framing is read once, out of order, and read ahead would be wasted). Blocks
    /// fetched before the cache was crowded still serve: an object's first block, fetched when
    /// the first objects were opened, holds the framing of its first archive.
    fn read_framing(&self, range: Range<u64>) -> Result<Vec<u8>> {
        let mut v = vec![0u8; (range.end - range.start) as usize];
        if self.crowded() {
            match self.cached(range.clone()) {
                Some(blocks) => self.copy_from(&blocks, range.start, &mut v)?,
                None => self.get_exact(range.start, &mut v)?,
            }
        } else {
            self.read_at(range.start, &mut v)?;
        }
        Ok(v)
    }

    /// [`OpenObject::prefetch`] of framing, unless the cache is crowded.
    fn prefetch_framing(&self, ranges: &[Range<u64>]) -> Result<()> {
        if self.crowded() {
            return Ok(());
        }
        self.prefetch(ranges)
    }

    /// An image of the ZIP archive of `len` bytes at `base`: its framing and small records
    /// ([`crate::zip::framing`]) are fetched, in three rounds of concurrent GETs; other bytes are
    /// zeros. An archive whose
    /// framing does not parse gets what was found, and the ZIP reader reports the problem.
    pub(crate) fn zip_image(&self, base: u64, len: u64) -> Result<Option<Mmap>> {
        if len == 0 {
            return Ok(None);
        }
        if base.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::invalid(format!(
                "{len} bytes at offset {base} run past the end of the object ({} bytes)",
                self.len
            ))
            .file(&self.at.path)
            .at(base));
        }
        if len <= BLOCK_BYTES && self.crowded() {
            // A small archive among many objects: one GET of all of it beats rounds of small
            // ones, and blocks would be evicted before its neighbours are read.
            let whole = vec![(0, self.read_framing(base..base + len)?)];
            return image_of(len, whole, &self.at.path);
        }
        let mut read = |r: Range<u64>| self.read_framing(base + r.start..base + r.end);
        let mut ahead = |ranges: &[Range<u64>]| {
            let small: Vec<Range<u64>> = ranges
                .iter()
                .filter(|r| r.end - r.start <= BLOCK_BYTES)
                .map(|r| base + r.start..base + r.end)
                .collect();
            self.prefetch_framing(&small)
        };
        let found = crate::zip::framing(len, &mut read, &mut ahead)?;
        image_of(len, found, &self.at.path)
    }
}

/// An image of `len` bytes holding `found` (offset, bytes) and zeros elsewhere.
fn image_of(len: u64, found: Vec<(u64, Vec<u8>)>, path: &Path) -> Result<Option<Mmap>> {
    let mut image = memmap2::MmapOptions::new()
        .len(usize::try_from(len).unwrap_or(usize::MAX))
        .no_reserve_swap()
        .map_anon()
        .map_err(|e| Error::io(path, e))?;
    for (at, bytes) in found {
        let at = at as usize;
        if let Some(dst) = image.get_mut(at..at + bytes.len()) {
            dst.copy_from_slice(&bytes);
        }
    }
    image
        .make_read_only()
        .map(Some)
        .map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object of `len` bytes (byte `i` is `i * 7 % 251`) in an in-memory store.
    fn in_memory(len: usize) -> (OpenObject, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        (object_of(&bytes), bytes)
    }

    /// An object holding `bytes` in an in-memory store.
    fn object_of(bytes: &[u8]) -> OpenObject {
        let bytes = bytes.to_vec();
        let mem = Arc::new(object_store::memory::InMemory::new());
        let key = Key::from("ckpt/__0_0.distcp");
        block_on(mem.put(&key, bytes.clone().into()))
            .unwrap()
            .unwrap();
        let store = Arc::new(Store {
            name: "s3://mem".into(),
            objects: mem.clone(),
            multipart: mem,
            parts_are_objects: false,
        });
        let path = PathBuf::from("s3://mem/ckpt/__0_0.distcp");
        Remote { store, key, path }.open().unwrap()
    }

    #[test]
    fn the_image_of_an_archive_holds_its_framing_and_small_records() {
        // Real torch.save archives, placed after other bytes as a DCP item is in a rank file.
        for archive in [
            &include_bytes!("../formats/testdata/views.pt")[..],
            include_bytes!("../formats/testdata/dtypes.pt"),
            include_bytes!("../formats/testdata/nested.pt"),
            include_bytes!("../formats/testdata/bare.pt"),
        ] {
            let base = 1000;
            let mut bytes: Vec<u8> = (0..base).map(|i| (i % 251) as u8).collect();
            bytes.extend_from_slice(archive);
            bytes.extend_from_slice(b"after the archive");
            let o = object_of(&bytes);
            let image = o
                .zip_image(base as u64, archive.len() as u64)
                .unwrap()
                .unwrap();
            let entries = crate::zip::read_entries(archive).unwrap();
            assert_eq!(crate::zip::read_entries(&image).unwrap(), entries);
            for e in &entries {
                let range = e.data_offset as usize..(e.data_offset + e.len) as usize;
                assert_eq!(image[range.clone()], archive[range], "{}", e.name);
            }
        }
    }

    #[test]
    fn windows_serve_reads_that_straddle_them_whatever_was_fetched_between() {
        let (o, bytes) = in_memory(1 << 20);
        o.ahead.lock().unwrap().size = 64 << 10;
        let read = |at: usize, n: usize| {
            let mut buf = vec![0u8; n];
            o.read_ahead_of(at as u64, &mut buf).unwrap();
            assert_eq!(buf, bytes[at..at + n], "{n} bytes at {at}");
        };
        let windows = |o: &OpenObject| -> Vec<u64> {
            o.ahead
                .lock()
                .unwrap()
                .held
                .iter()
                .map(|(k, _)| *k)
                .collect()
        };
        read((2 << 16) + 10, 100);
        // Another worker, further on.
        read((7 << 16) + 10, 100);
        assert_eq!(windows(&o), [2, 7]);
        // Straddles windows 2 and 3: 7 leaves, not 2, the older but needed.
        read((3 << 16) - 50, 100);
        assert_eq!(windows(&o), [2, 3]);
        // Larger than a window: fetched just so, the windows kept.
        read(5 << 16, 100 << 10);
        assert_eq!(windows(&o), [2, 3]);
        // The object's last, short window.
        read((1 << 20) - 30, 30);
        assert_eq!(windows(&o), [3, 15]);
    }

    fn generic(text: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: text.into(),
        }
    }

    #[test]
    fn throttling_names_the_object_the_status_and_the_code() {
        let e = store_error(
            Path::new("s3://b/dcp/__0_0.distcp"),
            generic(
                "Error performing GET http://127.0.0.1:40399/b/dcp/__0_0.distcp in 2s, after 5 \
                 retries - Server returned non-2xx status code: 503 Service Unavailable: \
                 <?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
                 <Message>Please reduce your request rate.</Message></Error>\n",
            ),
        );
        let msg = e.headline();
        assert!(msg.contains("s3://b/dcp/__0_0.distcp"), "{msg}");
        assert!(
            msg.contains("503 Service Unavailable: SlowDown: Please reduce your request rate."),
            "{msg}"
        );
        assert!(!msg.contains('<') && !msg.contains('\n'), "{msg}");
        let hint = e.hint.unwrap_or_default();
        assert!(
            hint.contains("throttled") && hint.contains("--threads"),
            "{hint}"
        );
        let e = store_error(
            Path::new("gs://b/x"),
            generic("Server returned non-2xx status code: 429 Too Many Requests: "),
        );
        assert!(e.hint.unwrap_or_default().contains("throttled"));
    }

    #[test]
    fn a_port_is_not_a_status() {
        // A refused connection to a port that holds 403 or 503 is not a credentials problem.
        let e = store_error(
            Path::new("s3://b/x"),
            generic(
                "Error performing HEAD http://127.0.0.1:40350/b/x in 1s - error sending request",
            ),
        );
        assert!(e.hint.unwrap_or_default().contains("AWS_ENDPOINT_URL"));
    }

    #[test]
    fn hints_name_the_variables_of_the_url_scheme() {
        let forbidden = || generic("Server returned non-2xx status code: 403 Forbidden: ");
        let refused =
            || generic("Error performing HEAD http://127.0.0.1:1/b/x - error sending request");
        for (url, vars) in [
            ("s3://b/x", "AWS_"),
            ("az://b/x", "AZURE_STORAGE_ACCOUNT_"),
            ("gs://b/x", "GOOGLE_"),
        ] {
            for e in [forbidden(), refused()] {
                let hint = store_error(Path::new(url), e).hint.unwrap_or_default();
                assert!(hint.contains(vars), "{url}: {hint}");
            }
        }
    }

    #[test]
    fn condense_keeps_text_without_an_error_body() {
        assert_eq!(
            condense_xml("status code: 500: oops"),
            "status code: 500: oops"
        );
        assert_eq!(
            condense_xml("x: <Error><Code>NoSuchBucket</Code></Error>"),
            "x: NoSuchBucket"
        );
        assert_eq!(condense_xml("</Error> <Error>"), "</Error> <Error>");
    }
}
