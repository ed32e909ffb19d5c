"""The on-storage format, and the only package that knows it: file names and versions (``paths``),
the manifest and its rank parts (``manifest``), the coordinators' arrays and owners files
(``shards``), save ids binding each file to its save (``saveid``), the checks on every value read
back (``values``), zarr documents, checksums and seals (``codec``), the chunk grid (``layout``),
user metadata (``metadata``), committed steps (``steps``), replica markers (``replicas``) and
verification of a stored step (``verify``). No torch here."""
