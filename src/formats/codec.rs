//! Decoding of piece data that is not plain bytes in its file: a zstd DCP item, a deflated
//! torch.save record, a DCP item left unopened. Readers describe such data with an
//! [`Encoding`]; the executor asks this module for the bytes, so it never names a format. Each
//! decoder is its format's own; this is where they are told apart.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::model::Encoding;

/// The decoded bytes of an encoded item (`item`, the item's bytes as stored), at least its first
/// `needed` bytes where the encoding can stop early: the decompressed zstd item or inflated
/// record, or the elements of an unopened DCP item in row-major order (checked against the
/// chunk its [`Encoding::Saved`] records). Plain bytes are not encoded and are refused here.
pub(crate) fn decode(
    encoding: &Encoding,
    item: &[u8],
    needed: u64,
    dtype: DType,
) -> Result<Vec<u8>> {
    match *encoding {
        Encoding::Raw | Encoding::Zeros => Err(Error::bug("plain bytes handed to the decoder")),
        Encoding::Zstd { .. } => super::dcp::zstd_prefix(item, needed),
        Encoding::Deflate { .. } => crate::zip::inflate_prefix(item, needed),
        Encoding::Saved { numel, shape, .. } => {
            super::dcp::saved_elements(item, dtype, numel, shape)
        }
    }
}
