"""gkbuild: the build pipeline for GPT-OSS giga-kernel (fused decode) serving."""

__version__ = "0.1.0"
