"""Image inputs on the host (docs/design.md §13): loading and hashing images
(image.py) and each model's own preprocessing (qwen2_vl.py), in numpy and Pillow:
the runtime carries no torch or torchvision."""
