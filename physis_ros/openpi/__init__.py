"""openpi's websocket protocol on the serving core: :class:`OpenpiFrontEnd` serves openpi clients
(``openpi_client.WebsocketClientPolicy``) from a :class:`~physis_ros.serving.Server`, many at once
(:mod:`~physis_ros.openpi.frontend`); :mod:`~physis_ros.openpi.codec` reads and writes openpi's msgpack
without pickle and maps an observation onto a model's inputs."""

from physis_ros.openpi.frontend import OpenpiFrontEnd

__all__ = ["OpenpiFrontEnd"]
