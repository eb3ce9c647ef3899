"""ImageData (list file of images) and MemoryData (arrays through net.set_input_arrays)."""
import cv2
import numpy as np
import pytest
from google.protobuf import text_format

from caffepy import rng
from caffepy.errors import CaffepyError, DataError
from caffepy.net import Net
from caffepy.proto import caffe_pb2

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


def build(text, phase=TRAIN, seed=3):
    rng.seed(seed)
    p = caffe_pb2.NetParameter()
    text_format.Parse(text, p)
    return Net(p, phase=phase, source="net.prototxt")


@pytest.fixture
def image_list(tmp_path):
    for i in range(5):
        img = np.full((6, 8, 3), 0, np.uint8)
        img[..., 0], img[..., 1], img[..., 2] = 10 * i, 1, 2           # B channel tells the image
        cv2.imwrite(str(tmp_path / f"im {i}.png"), img)                  # a space in the name
    (tmp_path / "list.txt").write_text("".join(f"im {i}.png {i}\n" for i in range(5)))
    return tmp_path


def image_net(root, extra="", transform=""):
    return (f'layer {{ name: "data" type: "ImageData" top: "data" top: "label"\n'
            f'  image_data_param {{ source: "{root / "list.txt"}" root_folder: "{root}/" batch_size: 2 {extra} }}\n'
            f'  transform_param {{ {transform} }} }}\n')


def test_image_data_reads_list_in_order_and_wraps(image_list):
    net = build(image_net(image_list))
    seen = []
    for _ in range(5):                                   # 10 reads of 5 images
        net.forward()
        seen += list(net.blobs["label"].data)
        np.testing.assert_array_equal(net.blobs["data"].data[:, 0, 0, 0], 10 * net.blobs["label"].data)
    assert seen == [0, 1, 2, 3, 4] * 2
    assert net.blobs["data"].data.shape == (2, 3, 6, 8)


def test_image_data_resize_gray_crop(image_list):
    net = build(image_net(image_list, "new_height: 4 new_width: 5 is_color: false", "crop_size: 3"), TEST)
    net.forward()
    assert net.blobs["data"].data.shape == (2, 1, 3, 3)


def test_image_data_intel_bgr2rgb_gives_rgb_order(image_list):
    net = build(image_net(image_list, "", "bgr2rgb: true"), TEST)
    net.forward()
    data = net.blobs["data"].data
    assert data[1, 0, 0, 0] == 2 and data[1, 1, 0, 0] == 1 and data[1, 2, 0, 0] == 10


def test_image_data_shuffle_each_epoch(image_list):
    net = build(image_net(image_list, "shuffle: true"))
    seen = []
    for _ in range(10):
        net.forward()
        seen += [int(v) for v in net.blobs["label"].data]
    for e in range(4):
        assert sorted(seen[5 * e:5 * e + 5]) == [0, 1, 2, 3, 4]


def test_image_data_errors(image_list):
    with pytest.raises(CaffepyError, match="set new_height and new_width together"):
        build(image_net(image_list, "new_height: 4"))
    (image_list / "list.txt").write_text("im 0.png 0\nim 9.png 9\n")
    net = build(image_net(image_list))
    with pytest.raises(DataError, match=r"list.txt: image 'im 9.png': cannot read the image file"):
        net.forward()


MEMORY = ('layer { name: "mem" type: "MemoryData" top: "data" top: "label"\n'
          '  memory_data_param { batch_size: 2 channels: 1 height: 2 width: 3 } }\n')


def test_memory_data_walks_the_arrays():
    net = build(MEMORY)
    data = np.arange(4 * 6, dtype=np.float32).reshape(4, 1, 2, 3)
    net.set_input_arrays(data, np.array([5, 6, 7, 8]))
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[:2])
    np.testing.assert_array_equal(net.blobs["label"].data, [5, 6])
    net.forward()
    net.forward()                                        # wraps to the start
    np.testing.assert_array_equal(net.blobs["label"].data, [5, 6])


def test_memory_data_errors():
    net = build(MEMORY)
    with pytest.raises(CaffepyError, match="no arrays to read.*set_input_arrays"):
        net.forward()
    with pytest.raises(CaffepyError, match=r"multiple of batch_size \(2\), got 3"):
        net.set_input_arrays(np.zeros((3, 1, 2, 3)), np.zeros(3))
    with pytest.raises(CaffepyError, match=r"data: must be N x 1 x 2 x 3"):
        net.set_input_arrays(np.zeros((2, 1, 3, 3)), np.zeros(2))
    other = build('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 } } }')
    with pytest.raises(CaffepyError, match="the first layer must be MemoryData"):
        other.set_input_arrays(np.zeros((2, 1, 2, 3)), np.zeros(2))
