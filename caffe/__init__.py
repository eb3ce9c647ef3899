"""pycaffe's name for caffepy: after `import caffe`, `caffe` is the caffepy module itself and
`caffe.X` is caffepy.X (see caffepy/pycaffe_name.py, which also says what happens when a real
Caffe is on the path too)."""
from caffepy import pycaffe_name

pycaffe_name.install()
