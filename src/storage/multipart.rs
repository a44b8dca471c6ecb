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
