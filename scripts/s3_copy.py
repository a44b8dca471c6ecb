"""The reference of `scripts/bench --s3`: a plain boto3 copy of the same bytes through the same
S3 server (boto3's managed transfers: multipart above 8 MB, 10 threads), and the bench's setup.
A prefix is listed once and its objects go through one transfer manager, so its 10 threads are
shared by all of them (many small rank files are fetched 10 at a time, not one after another),
and each download is told its size and ETag from the listing (no HeadObject per object).

    s3_copy.py setup BUCKET DIR PREFIX     create BUCKET, upload every file of DIR under PREFIX/
    s3_copy.py down BUCKET PREFIX DIR      download every object under PREFIX/ into DIR
    s3_copy.py up FILE BUCKET KEY          upload FILE as KEY
    s3_copy.py downup BUCKET PREFIX KEY    download PREFIX/'s objects, upload their bytes as KEY
                                           (what an S3 -> S3 conversion moves, through this host)

The endpoint and credentials come from the AWS_* variables, as for ckpt."""

import os
import sys
import tempfile
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from s3transfer.subscribers import BaseSubscriber


def client():
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


class _Size(BaseSubscriber):
    """Tells a download its size and ETag, known from the listing, so that it sends no HeadObject."""

    def __init__(self, size: int, etag: str):
        self.size, self.etag = size, etag

    def on_queued(self, future, **kwargs):
        future.meta.provide_transfer_size(self.size)
        future.meta.provide_object_etag(self.etag)


def upload_dir(c, local: Path, bucket: str, prefix: str) -> None:
    with create_transfer_manager(c, TransferConfig()) as tm:
        futures = [
            tm.upload(str(f), bucket, f"{prefix}/{f.relative_to(local).as_posix()}")
            for f in sorted(local.rglob("*"))
            if f.is_file()
        ]
        for fut in futures:
            fut.result()


def download(c, bucket: str, prefix: str, local: Path) -> list[Path]:
    objects = [
        o
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for o in page.get("Contents", [])
    ]
    out = []
    with create_transfer_manager(c, TransferConfig()) as tm:
        futures = []
        for o in objects:
            dest = local / o["Key"][len(prefix) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            futures.append(tm.download(bucket, o["Key"], str(dest), subscribers=[_Size(o["Size"], o["ETag"])]))
            out.append(dest)
        for fut in futures:
            fut.result()
    return out


def main(argv):
    c = client()
    match argv:
        case ["setup", bucket, d, prefix]:
            c.create_bucket(Bucket=bucket)
            upload_dir(c, Path(d), bucket, prefix)
        case ["down", bucket, prefix, d]:
            download(c, bucket, prefix, Path(d))
        case ["up", f, bucket, key]:
            c.upload_file(f, bucket, key)
        case ["downup", bucket, prefix, key]:
            with tempfile.TemporaryDirectory() as tmp:
                files = download(c, bucket, prefix, Path(tmp))
                joined = Path(tmp) / "joined"
                with open(joined, "wb") as out:
                    for f in sorted(files):
                        out.write(f.read_bytes())
                c.upload_file(str(joined), bucket, key)
        case _:
            sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
