"""Optional glue between sparktune and other libraries.

Each submodule imports its library when it is itself imported, never before: importing
``sparktune`` (or this package) imports none of them.

- :mod:`sparktune.integrations.transformers`: ``attn_implementation="sparktune"`` for Hugging
  Face transformers models.
"""

from __future__ import annotations
