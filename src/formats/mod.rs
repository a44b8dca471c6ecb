//! Readers and writers of each on-disk layout.
