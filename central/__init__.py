
from central import watermark  # noqa: F401
