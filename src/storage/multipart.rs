//! Plain object operations on a [`Remote`] location for writers: whole-object put, get, head and
//! delete, listing, and the steps of a multipart upload (create, upload a part, complete, abort).
//! What to upload, in which order, and what makes an output complete is the output module's
//! business; this knows only objects.

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
    /// completes), and the id is the prefix they are staged at.
    pub(crate) fn create_upload(&self, staging: &Remote) -> Result<String> {
        if self.store.parts_are_objects {
            return Ok(super::gcs::upload_id(&staging.key));
        }
        block_on(self.store.multipart.create_multipart(&self.key))?
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
        let parts = parts.into_iter().map(|p| p.0).collect();
        block_on(
            self.store
                .multipart
                .complete_multipart(&self.key, &id.to_string(), parts),
        )?
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

#[cfg(test)]
mod tests {
    use super::super::remote::Store;
    use super::*;
    use async_trait::async_trait;
    use futures::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::{
        CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
        PutMode, PutMultipartOptions, PutOptions, PutResult,
    };
    use std::sync::Arc;

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
