//! The ZIP subset torch.save uses: stored (uncompressed) entries, data aligned to 64 bytes, zip64
//! when large. Reading locates entries inside a byte slice; writing lays out framing around data
//! the executor fills in later.
