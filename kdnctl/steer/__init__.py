"""Attention-steering edits (PASTA) on stored KV caches: ``kdnctl edit --steer``.

Modules: :mod:`.spans` (SPEC -> token ranges), :mod:`.heads` (which layer/head pairs),
:mod:`.base` (bias semantics, registry, ``steer_document``), one file per edit mode
(:mod:`.pasta_bias`, :mod:`.reprefill`) and :mod:`.profile` (head profiling). See docs/steering.md.
"""
