"""Every layer type, one module per family; importing this package registers them all.

Find a layer by its prototxt type:  data (Input, DummyData, Data, ImageData, MemoryData,
WindowData), vision (Convolution, Deconvolution, Pooling, Im2col, Crop, SPP, ROIPooling,
PSROIPooling, Reorg), normalization (LRN, BatchNorm, MVN), neuron (ReLU, Sigmoid, Dropout, ...), common
(InnerProduct, Concat, Split, Eltwise, Softmax, BatchReindex, Filter, Parameter, ...),
recurrent (LSTM, RNN, LSTMUnit), loss (SoftmaxWithLoss, Accuracy, ..., Fast R-CNN's SmoothL1Loss,
R-FCN's SoftmaxWithLossOHEM, SmoothL1LossOHEM, BoxAnnotatorOHEM), python (Python), yolo
(RegionLoss, EvalDetection),
hdf5 (HDF5Data, HDF5Output), detection (SSD's Permute, Normalize, PriorBox, DetectionOutput),
intel (IntelPack, IntelUnpack, and the blocked variants of Convolution, Pooling, LRN, Concat,
BatchNorm, Scale), nhwc (NHWCPack, NHWCUnpack, and the channels-last variants of Convolution,
Pooling, BatchNorm, Scale, Bias, Concat, LRN that the fast path's layout plan uses), bf16
(the bf16 variants of Convolution and InnerProduct, caffepy/precision.py). The
model-parallel InnerProduct lives in caffepy/parallel/model_parallel.py; caffepy/layer.py says
how the factory chooses among a type's variants, caffepy/layout_plan.py which layout a net's
layers run in.
"""
from . import common, data, detection, hdf5, loss, neuron, normalization, python, recurrent, vision, yolo, intel, nhwc, bf16  # noqa: F401,E501
