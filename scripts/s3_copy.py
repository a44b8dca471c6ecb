"""The reference of `scripts/bench --s3`: a plain boto3 copy of the same bytes through the same
S3 server (boto3's managed transfers: multipart above 8 MB, 10 threads), and the bench's setup.

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


def client():
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


def upload_dir(c, local: Path, bucket: str, prefix: str) -> None:
    for f in sorted(local.rglob("*")):
        if f.is_file():
            c.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(local).as_posix()}")


def download(c, bucket: str, prefix: str, local: Path) -> list[Path]:
    out = []
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            dest = local / o["Key"][len(prefix) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            c.download_file(bucket, o["Key"], str(dest))
            out.append(dest)
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
