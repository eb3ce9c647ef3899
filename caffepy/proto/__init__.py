"""Caffe's schema: caffe.proto (written by us, Caffe's names and numbers) and the
module protoc generates from it, importable as caffepy.proto.caffe_pb2."""
