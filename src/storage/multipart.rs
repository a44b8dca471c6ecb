//! Plain object operations on a [`Remote`] location for writers: whole-object put, get, head and
//! delete, listing, and the steps of a multipart upload (create, upload a part, complete, abort),
//! the creates, completes and aborts of many uploads a few dozen at once.
//! What to upload, in which order, and what makes an output complete is the output module's
//! business; this knows only objects.

use std::sync::atomic::{AtomicBool, Ordering};

use object_store::multipart::PartId;
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, PutPayload};

use super::remote::{block_on, runtime, store_error, Remote};
use crate::error::{Error, ErrorKind, Result};

/// How long a part already being sent is let finish when its run stops, where parts are objects.
const DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A part of a multipart upload, sent and acknowledged: what [`Remote::complete_upload`] takes.
#[derive(Clone, Debug)]
pub(crate) struct UploadedPart(PartId);

/// A part of a multipart upload being sent in the background, cancelled when dropped unwaited (a
/// failed or interrupted run). Where parts are objects (GCS), it is first let finish for a few
/// seconds: a cancelled request whose body was sent is still stored, and a part stored after the
/// abort has deleted the others would stay.
pub(crate) struct PendingPart {
    handle: Option<tokio::task::JoinHandle<object_store::Result<PartId>>>,
    at: Remote,
}

impl PendingPart {
    /// Wait until the store has acknowledged the part.
    pub(crate) fn wait(mut self) -> Result<UploadedPart> {
        let handle = self
            .handle
            .take()
            .ok_or_else(|| Error::bug("an upload part was waited for twice"))?;
        let done = block_on(handle)?
            .map_err(|e| Error::new(ErrorKind::Io, format!("upload task failed: {e}")))?;
        done.map(UploadedPart)
            .map_err(|e| store_error(&self.at.path, e))
    }
}

impl Drop for PendingPart {
    fn drop(&mut self) {
        if let Some(mut handle) = self.handle.take() {
            if self.at.store.parts_are_objects {
                let drained = block_on(async { tokio::time::timeout(DRAIN, &mut handle).await });
                // A finished handle may not be waited for again.
                if matches!(drained, Ok(Ok(_))) {
                    return;
                }
            }
            handle.abort();
            let _ = block_on(handle);
        }
    }
}

impl Remote {
    /// The object key, without the store's scheme and bucket.
    pub(crate) fn key(&self) -> &str {
        self.key.as_ref()
    }

    /// The last segment of the key, if any.
    pub(crate) fn file_name(&self) -> Option<&str> {
        self.key.filename()
    }

    /// Another key in the same store.
    pub(crate) fn with_key(&self, key: &str) -> Result<Remote> {
        let key =
            Key::parse(key).map_err(|e| Error::invalid(format!("object key `{key}`: {e}")))?;
        Ok(self.at(key))
    }

    /// `rel` (`/`-separated) below this location taken as a directory.
    pub(crate) fn join(&self, rel: &str) -> Result<Remote> {
        if self.key.as_ref().is_empty() {
            return self.with_key(rel);
        }
        self.with_key(&format!("{}/{rel}", self.key))
    }

    /// The location this one is directly below (the bucket's root for a one-segment key).
    pub(crate) fn parent(&self) -> Remote {
        let parts: Vec<_> = self.key.parts().collect();
        let up = parts.len().saturating_sub(1);
        self.at(Key::from_iter(parts[..up].iter().cloned()))
    }

    fn at(&self, key: Key) -> Remote {
        Remote {
            store: self.store.clone(),
            path: self.path_of(&key),
            key,
        }
    }

    /// Whether an object is stored under exactly this key.
    pub(crate) fn exists(&self) -> Result<bool> {
        match block_on(self.store.objects.head(&self.key))? {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(store_error(&self.path, e)),
        }
    }

    /// Every object under this location taken as a directory (`key/...`).
    pub(crate) fn objects_below(&self) -> Result<Vec<Remote>> {
        Ok(self.list_below()?.into_iter().map(|k| self.at(k)).collect())
    }

    /// Remove the object (nothing to do if there is none).
    pub(crate) fn delete(&self) -> Result<()> {
        match block_on(self.store.objects.delete(&self.key))? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store_error(&self.path, e)),
        }
    }

    /// Start a multipart upload to this key; its id. Where parts are objects (GCS) they are
    /// staged under `staging` (outside the output, so that nothing is under its name before it
    /// completes), and the id is the prefix they are staged at. Runs create theirs a few dozen at
    /// once, with [`create_uploads`].
    #[cfg(test)]
    pub(crate) fn create_upload(&self, staging: &Remote) -> Result<String> {
        block_on(self.create_upload_async(staging))?
    }

    async fn create_upload_async(&self, staging: &Remote) -> Result<String> {
        if self.store.parts_are_objects {
            return Ok(super::gcs::upload_id(&staging.key));
        }
        self.store
            .multipart
            .create_multipart(&self.key)
            .await
            .map_err(|e| store_error(&self.path, e))
    }

    /// Send part `k` (0-based: part numbers, not upload time, fix the order) of upload `id` in
    /// the background.
    pub(crate) fn upload_part(&self, id: &str, k: usize, bytes: Vec<u8>) -> Result<PendingPart> {
        let (mp, key, id) = (
            self.store.multipart.clone(),
            self.key.clone(),
            id.to_string(),
        );
        let payload = PutPayload::from(bytes::Bytes::from(bytes));
        let handle = runtime()?.spawn(async move { mp.put_part(&key, &id, k, payload).await });
        Ok(PendingPart {
            handle: Some(handle),
            at: self.clone(),
        })
    }

    /// Complete upload `id` from its parts in order: the object appears.
    pub(crate) fn complete_upload(&self, id: &str, parts: Vec<UploadedPart>) -> Result<()> {
        block_on(self.complete_upload_async(id, parts))?
    }

    async fn complete_upload_async(&self, id: &str, parts: Vec<UploadedPart>) -> Result<()> {
        let parts = parts.into_iter().map(|p| p.0).collect();
        self.store
            .multipart
            .complete_multipart(&self.key, &id.to_string(), parts)
            .await
            .map(|_| ())
            .map_err(|e| store_error(&self.path, e))
    }

    /// Abort upload `id`; one already aborted or completed (not found) is no error.
    async fn abort(&self, id: String) -> bool {
        matches!(
            self.store.multipart.abort_multipart(&self.key, &id).await,
            Ok(()) | Err(object_store::Error::NotFound { .. })
        )
    }
}

impl UploadedPart {
    /// What the store calls the part (an S3 ETag, an Azure block id): what another process
    /// needs to complete an upload with it.
    pub(crate) fn id(&self) -> &str {
        &self.0.content_id
    }

    /// A part that another process sent, by the id it reported.
    pub(crate) fn from_id(id: String) -> UploadedPart {
        UploadedPart(PartId { content_id: id })
    }
}

/// An object's version as a listing or a HEAD tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Version {
    pub(crate) key: String,
    pub(crate) size: u64,
    /// The ETag, or the time of the last change where the store gives no ETag.
    pub(crate) tag: String,
}

impl Version {
    fn of(meta: object_store::ObjectMeta) -> Version {
        Version {
            key: meta.location.to_string(),
            size: meta.size,
            tag: meta
                .e_tag
                .unwrap_or_else(|| meta.last_modified.to_rfc3339()),
        }
    }
}

impl Remote {
    /// `key` in a store of its own in memory, for tests of what writes to object storage.
    #[cfg(test)]
    pub(crate) fn in_memory(key: &str) -> Remote {
        let mem = std::sync::Arc::new(object_store::memory::InMemory::new());
        let store = super::remote::Store {
            name: "s3://mem".into(),
            objects: mem.clone(),
            multipart: mem,
            parts_are_objects: false,
        };
        Remote {
            store: std::sync::Arc::new(store),
            key: Key::from(key),
            path: format!("s3://mem/{key}").into(),
        }
    }

    /// Store `bytes` as the object unless there is one (a conditional PUT, S3's and Azure's
    /// `If-None-Match: *`, GCS's `ifGenerationMatch=0`): true when this call created it. Of many
    /// callers at once, one does. Callers write bytes no other caller writes (their host,
    /// process and moment), which tells this call's object from another's.
    pub(crate) fn put_new(&self, bytes: Vec<u8>) -> Result<bool> {
        let opts = object_store::PutOptions {
            mode: object_store::PutMode::Create,
            ..Default::default()
        };
        let bytes = bytes::Bytes::from(bytes);
        match block_on(self.store.objects.put_opts(
            &self.key,
            PutPayload::from(bytes.clone()),
            opts,
        ))? {
            Ok(_) => Ok(true),
            // A PUT whose reply was lost is sent again, and the second finds the object the
            // first created: this call's own when it holds these bytes.
            Err(object_store::Error::AlreadyExists { .. }) => {
                Ok(self.read_if_any()?.is_some_and(|there| there == bytes))
            }
            Err(e) => Err(store_error(&self.path, e)),
        }
    }

    /// The whole object, or `None` when there is none.
    pub(crate) fn read_if_any(&self) -> Result<Option<Vec<u8>>> {
        let got = block_on(async {
            let r = self.store.objects.get(&self.key).await?;
            r.bytes().await
        })?;
        match got {
            Ok(b) => Ok(Some(b.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_error(&self.path, e)),
        }
    }

    /// The version of every object under this location taken as a directory, or of the object
    /// itself when there are none below: one listing, however many objects.
    pub(crate) fn versions(&self) -> Result<Vec<Version>> {
        use futures::stream::TryStreamExt;
        let prefix = Some(&self.key).filter(|k| !k.as_ref().is_empty());
        let mut below: Vec<Version> = block_on(
            self.store
                .objects
                .list(prefix)
                .map_ok(Version::of)
                .try_collect(),
        )?
        .map_err(|e| store_error(&self.path, e))?;
        if below.is_empty() {
            match block_on(self.store.objects.head(&self.key))? {
                Ok(meta) => below.push(Version::of(meta)),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store_error(&self.path, e)),
            }
        }
        below.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(below)
    }
}

impl Remote {
    /// Complete upload `id` as [`Remote::complete_upload`] does; false when the store knows no
    /// such upload (completed or aborted before).
    pub(crate) fn complete_open_upload(&self, id: &str, parts: Vec<UploadedPart>) -> Result<bool> {
        let parts = parts.into_iter().map(|p| p.0).collect();
        match block_on(
            self.store
                .multipart
                .complete_multipart(&self.key, &id.to_string(), parts),
        )? {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(store_error(&self.path, e)),
        }
    }
}

/// Uploads aborted at once: a run into a thousand rank files has a thousand open when it is
/// interrupted, and aborting them one after another would take seconds.
const ABORTS_IN_FLIGHT: usize = 32;

/// Abort every upload of `uploads` (where, upload id). False if one may still be open (its abort
/// failed, e.g. throttled past its retries).
pub(crate) fn abort_uploads(uploads: Vec<(Remote, String)>) -> bool {
    use futures::stream::StreamExt;
    let aborts = futures::stream::iter(uploads)
        .map(|(at, id)| async move { at.abort(id).await })
        .buffer_unordered(ABORTS_IN_FLIGHT)
        .collect::<Vec<bool>>();
    block_on(aborts).is_ok_and(|closed| closed.into_iter().all(|c| c))
}

/// Uploads created or completed at once. A reshard to a thousand ranks creates a thousand uploads
/// and completes a thousand: one after another, each waiting for its round trip (20-50 ms on S3),
/// that alone is 40-100 s.
const UPLOADS_IN_FLIGHT: usize = 32;

/// An upload to complete: its id and its parts in order.
pub(crate) type Upload = (String, Vec<UploadedPart>);

/// Start a multipart upload at each of `at` (as [`Remote::create_upload`]), up to
/// [`UPLOADS_IN_FLIGHT`] at once: the ids in the order of `at` (`None` where none was started)
/// and the first failure. Once one fails or `cancel` is set no other is begun, but those under
/// way finish and are reported: an upload that was created is always known, so it can be aborted.
pub(crate) fn create_uploads(
    at: &[Remote],
    staging: &Remote,
    cancel: &AtomicBool,
) -> (Vec<Option<String>>, Result<()>) {
    at_once(at, cancel, |to| to.create_upload_async(staging))
}

/// Make each of `objects` appear, up to [`UPLOADS_IN_FLIGHT`] at once: its upload (id and parts)
/// completed or, with none, the object stored empty. Which appeared, in order, and the first
/// failure, as [`create_uploads`] tells them: the caller deletes them again if the run fails.
pub(crate) fn complete_uploads(
    objects: &[(Remote, Option<Upload>)],
    cancel: &AtomicBool,
) -> (Vec<bool>, Result<()>) {
    let (done, result) = at_once(objects, cancel, |(to, upload)| async move {
        match upload {
            Some((id, parts)) => to.complete_upload_async(id, parts.clone()).await,
            None => to.put_async(Vec::new()).await,
        }
    });
    (done.iter().map(Option::is_some).collect(), result)
}

/// `op` of each of `items`, up to [`UPLOADS_IN_FLIGHT`] at once: the results in order (`None`
/// where it failed or was not begun) and the first failure. Once one fails or `cancel` is set no
/// other is begun (an interrupt stops a thousand within a round trip), but those under way are
/// let finish, so that what they made is known.
fn at_once<'a, T, R, F>(
    items: &'a [T],
    cancel: &AtomicBool,
    op: impl Fn(&'a T) -> F,
) -> (Vec<Option<R>>, Result<()>)
where
    F: std::future::Future<Output = Result<R>>,
{
    use futures::stream::StreamExt;
    let (op, failed) = (&op, &AtomicBool::new(false));
    let run = futures::stream::iter(items)
        .map(|item| async move {
            if failed.load(Ordering::Relaxed) || cancel.load(Ordering::Relaxed) {
                return None;
            }
            let r = op(item).await;
            if r.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            Some(r)
        })
        .buffered(UPLOADS_IN_FLIGHT)
        .collect::<Vec<_>>();
    let results = match block_on(run) {
        Ok(r) => r,
        Err(e) => return (items.iter().map(|_| None).collect(), Err(e)),
    };
    let (mut first, mut skipped) = (None, false);
    let done = results
        .into_iter()
        .map(|r| match r {
            Some(Ok(v)) => Some(v),
            Some(Err(e)) => {
                first.get_or_insert(e);
                None
            }
            None => {
                skipped = true;
                None
            }
        })
        .collect();
    let result = match first {
        Some(e) => Err(e),
        None if skipped => Err(Error::new(ErrorKind::Io, "interrupted")),
        None => Ok(()),
    };
    (done, result)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::PathBuf;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use futures::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::multipart::MultipartStore;
    use object_store::{
        CopyOptions, GetOptions, GetResult, ListResult, MultipartId, MultipartUpload, ObjectMeta,
        ObjectStore, PutMode, PutMultipartOptions, PutOptions, PutResult,
    };

    use super::*;
    use crate::storage::remote::Store;

    /// An in-memory store whose creates and completes each take 50 ms (a round trip to S3):
    /// counts how many are under way at once, and fails those of keys containing `fail`.
    /// Counts the uploads created and aborted too. (Also the store of `output::remote_part`'s
    /// tests of its starts.)
    pub(crate) struct Slow {
        inner: Arc<InMemory>,
        running: AtomicUsize,
        most: AtomicUsize,
        fail: Option<&'static str>,
        created: AtomicUsize,
        aborted: AtomicUsize,
    }

    impl Slow {
        async fn round_trip<T>(
            &self,
            key: &Key,
            call: impl std::future::Future<Output = object_store::Result<T>>,
        ) -> object_store::Result<T> {
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(50)).await;
            self.running.fetch_sub(1, Ordering::SeqCst);
            if self.fail.is_some_and(|f| key.as_ref().contains(f)) {
                return Err(object_store::Error::Generic {
                    store: "slow",
                    source: "refused".into(),
                });
            }
            call.await
        }

        /// How many were under way at once since the last call.
        pub(crate) fn most(&self) -> usize {
            self.most.swap(0, Ordering::SeqCst)
        }

        /// How many uploads were created, and how many aborted.
        pub(crate) fn created_and_aborted(&self) -> (usize, usize) {
            let created = self.created.load(Ordering::SeqCst);
            (created, self.aborted.load(Ordering::SeqCst))
        }
    }

    #[async_trait::async_trait]
    impl MultipartStore for Slow {
        async fn create_multipart(&self, key: &Key) -> object_store::Result<MultipartId> {
            let id = self
                .round_trip(key, self.inner.create_multipart(key))
                .await?;
            self.created.fetch_add(1, Ordering::SeqCst);
            Ok(id)
        }

        async fn put_part(
            &self,
            key: &Key,
            id: &MultipartId,
            k: usize,
            data: PutPayload,
        ) -> object_store::Result<PartId> {
            self.inner.put_part(key, id, k, data).await
        }

        async fn complete_multipart(
            &self,
            key: &Key,
            id: &MultipartId,
            parts: Vec<PartId>,
        ) -> object_store::Result<object_store::PutResult> {
            self.round_trip(key, self.inner.complete_multipart(key, id, parts))
                .await
        }

        async fn abort_multipart(&self, key: &Key, id: &MultipartId) -> object_store::Result<()> {
            self.aborted.fetch_add(1, Ordering::SeqCst);
            self.inner.abort_multipart(key, id).await
        }
    }

    /// `n` rank files under `out/` in a [`Slow`] store.
    pub(crate) fn ranks(n: usize, fail: Option<&'static str>) -> (Arc<Slow>, Vec<Remote>) {
        let inner = Arc::new(InMemory::new());
        let slow = Arc::new(Slow {
            inner: inner.clone(),
            running: AtomicUsize::new(0),
            most: AtomicUsize::new(0),
            fail,
            created: AtomicUsize::new(0),
            aborted: AtomicUsize::new(0),
        });
        let store = Arc::new(Store {
            name: "s3://mem".into(),
            objects: inner,
            multipart: slow.clone(),
            parts_are_objects: false,
        });
        let at = (0..n)
            .map(|i| {
                let key = Key::from(format!("out/__{i}_0.distcp"));
                let path = PathBuf::from(format!("s3://mem/{key}"));
                Remote {
                    store: store.clone(),
                    key,
                    path,
                }
            })
            .collect();
        (slow, at)
    }

    #[test]
    fn uploads_are_created_and_completed_many_at_once_each_for_its_file() {
        let (slow, at) = ranks(40, None);
        let staging = at[0].parent();
        let cancel = AtomicBool::new(false);
        let (ids, created) = create_uploads(&at, &staging, &cancel);
        created.unwrap();
        assert!(slow.most() > 1, "the creates ran one after another");
        // Each file's own bytes, sent under the id given back for it: a mixed-up order completes
        // some file with another's bytes.
        let objects: Vec<_> = at
            .iter()
            .zip(ids)
            .enumerate()
            .map(|(i, (to, id))| {
                let id = id.unwrap();
                let part = to.upload_part(&id, 0, i.to_string().into_bytes()).unwrap();
                (to.clone(), Some((id, vec![part.wait().unwrap()])))
            })
            .collect();
        let (done, completed) = complete_uploads(&objects, &cancel);
        completed.unwrap();
        assert!(done.iter().all(|&d| d));
        assert!(slow.most() > 1, "the completes ran one after another");
        for (i, to) in at.iter().enumerate() {
            assert_eq!(to.read_all().unwrap(), i.to_string().into_bytes());
        }
    }

    #[test]
    fn a_failed_create_is_named_and_those_started_are_told() {
        let (_slow, at) = ranks(40, Some("__7_"));
        let staging = at[0].parent();
        let (ids, created) = create_uploads(&at, &staging, &AtomicBool::new(false));
        let e = created.unwrap_err().to_string();
        assert!(e.contains("s3://mem/out/__7_0.distcp"), "{e}");
        assert!(ids[7].is_none());
        // Begun with it: created, so their ids are known to be aborted.
        assert!(ids[..7].iter().all(Option::is_some));
        let begun: Vec<(Remote, String)> = at
            .iter()
            .zip(&ids)
            .filter_map(|(to, id)| Some((to.clone(), id.clone()?)))
            .collect();
        assert!(abort_uploads(begun));
    }

    #[test]
    fn a_cancelled_run_begins_no_upload() {
        let (slow, at) = ranks(40, None);
        let staging = at[0].parent();
        let (ids, created) = create_uploads(&at, &staging, &AtomicBool::new(true));
        assert_eq!(created.unwrap_err().to_string(), "interrupted");
        assert!(ids.iter().all(Option::is_none));
        assert_eq!(slow.most(), 0);
    }

    /// A store whose conditional PUTs lose their reply: the object is created, and the client's
    /// retry is told it exists.
    #[derive(Debug)]
    struct LostReply(InMemory);

    impl std::fmt::Display for LostReply {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "LostReply")
        }
    }

    #[async_trait]
    impl ObjectStore for LostReply {
        async fn put_opts(
            &self,
            location: &Key,
            payload: PutPayload,
            opts: PutOptions,
        ) -> object_store::Result<PutResult> {
            let create = matches!(opts.mode, PutMode::Create);
            let put = self.0.put_opts(location, payload, opts).await?;
            if create {
                return Err(object_store::Error::AlreadyExists {
                    path: location.to_string(),
                    source: "412 Precondition Failed on the retry".into(),
                });
            }
            Ok(put)
        }
        async fn put_multipart_opts(
            &self,
            location: &Key,
            opts: PutMultipartOptions,
        ) -> object_store::Result<Box<dyn MultipartUpload>> {
            self.0.put_multipart_opts(location, opts).await
        }
        async fn get_opts(
            &self,
            location: &Key,
            options: GetOptions,
        ) -> object_store::Result<GetResult> {
            self.0.get_opts(location, options).await
        }
        fn delete_stream(
            &self,
            locations: BoxStream<'static, object_store::Result<Key>>,
        ) -> BoxStream<'static, object_store::Result<Key>> {
            self.0.delete_stream(locations)
        }
        fn list(
            &self,
            prefix: Option<&Key>,
        ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            self.0.list(prefix)
        }
        async fn list_with_delimiter(
            &self,
            prefix: Option<&Key>,
        ) -> object_store::Result<ListResult> {
            self.0.list_with_delimiter(prefix).await
        }
        async fn copy_opts(
            &self,
            from: &Key,
            to: &Key,
            options: CopyOptions,
        ) -> object_store::Result<()> {
            self.0.copy_opts(from, to, options).await
        }
    }

    fn remote(objects: Arc<dyn ObjectStore>, key: &str) -> Remote {
        let store = Arc::new(Store {
            name: "s3://mem".into(),
            objects,
            multipart: Arc::new(InMemory::new()),
            parts_are_objects: false,
        });
        Remote {
            store,
            key: Key::from(key),
            path: format!("s3://mem/{key}").into(),
        }
    }

    #[test]
    fn a_create_whose_reply_was_lost_is_still_this_callers() {
        let lock = remote(Arc::new(LostReply(InMemory::new())), "out/.lock");
        assert!(lock.put_new(b"part 1/3 on a (pid 7)".to_vec()).unwrap());
        // Another caller's attempt finds this one's object.
        assert!(!lock.put_new(b"part 2/3 on b (pid 9)".to_vec()).unwrap());
        let plain = remote(Arc::new(InMemory::new()), "out/.lock");
        assert!(plain.put_new(b"part 1/3 on a (pid 7)".to_vec()).unwrap());
        assert!(!plain.put_new(b"part 2/3 on b (pid 9)".to_vec()).unwrap());
    }
}
