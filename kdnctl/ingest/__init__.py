"""Ingest: documents -> prefill -> chunk bundles -> store.

``prefix`` stores one sequence per document (chunks keyed by a prefix hash chain);
``independent`` stores composable chunks prefilled on their own (keyed by content hash).
"""

from .prefix import (IngestOptions, IngestReport, Segment, SegmentResult, doc_version_for, document_segments,
                     ingest_documents, is_current, write_segment)

__all__ = ["IngestOptions", "IngestReport", "Segment", "SegmentResult", "doc_version_for", "document_segments",
           "ingest_documents", "is_current", "write_segment"]
