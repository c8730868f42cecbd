
from central import paretoq  # noqa: F401
from central import watermark  # noqa: F401
