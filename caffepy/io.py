"""pycaffe's caffe.io: array <-> BlobProto/Datum conversions and image helpers."""
from .blobproto import array_to_blobproto, blobproto_to_array  # noqa: F401
