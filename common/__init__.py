from common import import_noise as _import_noise

_import_noise.install()
