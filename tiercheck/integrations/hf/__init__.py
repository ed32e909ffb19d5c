"""Hugging Face safetensors in and out, with no dependency beyond tiercheck's own: the format (a
length, a JSON header, the bytes) is read and written here, streamed (``export``) and read into
memory the load owns (``pretrained``), where the ``safetensors`` library would hold whole shards
to write and map files to read.

* :func:`export` writes a committed step as a safetensors directory (``model-0000k-of-0000n.safetensors``
  and ``model.safetensors.index.json``) that ``transformers``' ``from_pretrained``, vLLM, SGLang and
  TGI load: every chunk verified on the way, in bounded memory, the directory appearing only whole.
* :func:`load_pretrained` fills a training state (plain tensors, ``tiercheck.Shard``, DTensors) from
  such a directory, local or remote, each rank reading only its slices; all or nothing.

Modules: ``files`` (the format: headers, shard names, index), ``names`` (training names <-> Hugging
Face names), ``export``, ``pretrained`` (``load_pretrained``).
"""

from tiercheck.integrations.hf.export import ExportResult, export
from tiercheck.integrations.hf.pretrained import load_pretrained

__all__ = ["ExportResult", "export", "load_pretrained"]
