"""The on-storage format, and the only package that knows it: file names and versions (``paths``),
the manifest and its parts (``manifest``), zarr documents, checksums and seals (``codec``), the
chunk grid (``layout``), user metadata (``metadata``), committed steps (``steps``), replica
markers (``replicas``) and verification of a stored step (``verify``). No torch here."""
