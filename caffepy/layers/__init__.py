"""Every layer type, one module per family; importing this package registers them all.

Find a layer by its prototxt type:  data (Input, DummyData, Data, ImageData, MemoryData),
vision (Convolution, Deconvolution, Pooling, Im2col, Crop), normalization (LRN,
BatchNorm, MVN), neuron (ReLU, Sigmoid, Dropout, ...), common (InnerProduct, Concat,
Split, Eltwise, Softmax, ...), loss (SoftmaxWithLoss, Accuracy, ...), python (Python),
intel (IntelPack, IntelUnpack).
"""
from . import common, data, loss, neuron, normalization, python, vision, intel  # noqa: F401
