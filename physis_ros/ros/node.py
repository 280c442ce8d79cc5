"""``physis_server``: the ROS 2 action server node (DESIGN.md sections 5 and 8).

Robots are streams. Those in the serve config are admitted at start-up, more join (and leave)
through the ``~/serve_stream`` action (:mod:`physis_ros.ros.serve_action`); every one is admitted
by the joint scheduler over the server's workers (:mod:`physis_ros.ros.hub`), and each has its own
model, placement and ROS side (:class:`~physis_ros.ros.stream_topics.RosStream`). Server-wide the node
publishes ``telemetry`` (one ChunkTelemetry per chunk) and ``/diagnostics`` (gathered in
:mod:`physis_ros.ros.diagnostics`). It is a lifecycle node: the outputs are published only while it is
active; every config key is a declared parameter (:mod:`physis_ros.ros.parameters`).

Threads: the rclpy executor runs the subscriptions, the action's goals (coroutines), the services
and the diagnostics timer; the engine runs on its own uvloop thread
(:class:`~physis_ros.serving.engine_thread.EngineThread`), takes observations from the streams and
publishes each finished chunk from its loop thread. All stamps come from the node clock, so
``use_sim_time`` replay works.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter

from physis_ros.config import ConfigError
from physis_ros.heap import HeapTrimmer
from physis_ros.msg import ChunkTelemetry
from physis_ros.ros import diagnostics, qos, rosout
from physis_ros.serving.capacity import Rejected
from physis_ros.serving.config import ServeConfig
from physis_ros.serving.fit import model_label
from physis_ros.serving.engine_thread import EngineThread
from physis_ros.serving.catalog import check_config_models
from physis_ros.serving.server import Server
from physis_ros.ros.hub import StreamHub
from physis_ros.ros.parameters import ServeParameters
from physis_ros.ros.serve_action import ServeStreamServer
from physis_ros.ros.stream_topics import RosStream

NODE_NAME = "physis_server"
SUCCESS = TransitionCallbackReturn.SUCCESS


class PhysisServer(LifecycleNode):
    """A managed (lifecycle) node. Built with the file mapping (``--config``) and command-line overrides;
    ROS parameters given to the node (``--params-file``, ``-p``, a launch file's ``parameters=``) sit
    between the two. Every config key is a declared parameter (:mod:`physis_ros.ros.parameters`).

    Lifecycle: configure starts the engine (workers) and admits the config's streams; activate arms
    the outputs (chunks reach the robots only while active; telemetry and /diagnostics always
    flow); deactivate disarms them at once (chunks keep computing); cleanup stops the engine;
    shutdown stops everything. ``physis-serve --autostart`` (the default) configures and activates
    at start."""

    def __init__(self, file_mapping: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 *, context=None, namespace: str | None = None, trajectory_topic: str = ""):
        super().__init__(NODE_NAME, context=context, namespace=namespace)
        self._rosout = rosout.attach(self.get_logger())  # engine and worker log lines -> /rosout
        self.params = ServeParameters(self, file_mapping, overrides, trajectory_topic)
        self.model = check_config_models(self.config)   # the default model; the config's streams fit theirs
        if self.config.use_sim_time:
            self.set_parameters([Parameter("use_sim_time", Parameter.Type.BOOL, True)])
        self.params.declare()
        self.ignored_parameters = self.params.ignored
        if self.ignored_parameters:
            self.get_logger().warning("ignoring parameters not known to physis_server (a shared parameters "
                                      "file?): " + ", ".join(self.ignored_parameters))
        self.heap = HeapTrimmer()       # the process's C heap, given back after a burst of large frames
        self.closing = False
        self.state = "unconfigured"    # engine: unconfigured, starting, serving, failed, stopping, stopped
        self.lifecycle = "unconfigured"
        self.armed = False
        self.finalized = False
        self.server: Server | None = None   # the serving application, from configure to cleanup
        self.openpi = None                   # its openpi front end (physis_ros.openpi), when openpi.port is set
        self.engine_started: float | None = None   # time.monotonic() of configure
        self.serving_since: float | None = None
        self.hostname = socket.gethostname()
        # /diagnostics names: '<node>: <what>' with the node's own name (a __node remap), never its namespace
        self.diag_prefix = self.get_name()
        self.summary: dict[str, dict] = {}   # totals of the streams of the servers stopped (Server.report)
        self.hub = StreamHub(self)
        self.pub_telemetry = self.create_publisher(ChunkTelemetry, self.config.telemetry_topic,
                                                   qos.profile(qos.TELEMETRY), qos_overriding_options=qos.OVERRIDES)
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", qos.profile(qos.DIAGNOSTICS))
        self.actions = ServeStreamServer(self)
        self.params.attach(self._apply_config, self._check_config)
        self.diagnostics_timer = self.create_timer(self.config.diagnostics_period_s, self.publish_diagnostics)

    # ---- set-up -------------------------------------------------------------------------------
    @property
    def config(self) -> ServeConfig:
        """The serve config now: start-up's, with the runtime parameter changes, the streams that joined
        through goals and without those that left (:class:`ServeParameters` keeps it with the parameters)."""
        return self.params.config

    @property
    def streams(self) -> dict[str, RosStream]:
        """The streams served on the node's topics (:class:`StreamHub` keeps them: joins and leaves)."""
        return self.hub.streams

    @property
    def startup(self) -> dict[str, str]:
        """Config stream -> ``admitted`` or its rejection, as the server records them (empty while unconfigured)."""
        return self.server.startup if self.server is not None else {}

    def now(self) -> float:
        """The node clock in seconds (ROS time: simulated under use_sim_time)."""
        return self.get_clock().now().nanoseconds * 1e-9

    @property
    def engine(self) -> EngineThread | None:
        """The server's engine (None while unconfigured)."""
        return self.server.engine if self.server is not None else None

    def _check_config(self, new: ServeConfig) -> None:
        """A runtime change must still fit each served stream's model (its SLO within its control timeline)."""
        if self.server is not None:
            self.server.check_update(new)

    def _apply_config(self, old: ServeConfig, new: ServeConfig) -> None:
        """A runtime parameter change was accepted (``self.config`` is ``new`` already): the streams take it
        (read per message and per chunk by the callbacks)."""
        if self.server is not None:
            self.server.update(new)

    def start_engine(self) -> None:
        c = self.config
        self.get_logger().info(f"starting engine: {c.engine.workers} worker(s), default model {model_label(c.model, self.model)}, "
                               f"{'deterministic' if c.deterministic else 'latest'} observations")
        self.closing = False
        self.server = Server(c, clock=self.now, log=logging.getLogger("physis.serving"))
        self.state = "starting"
        self.engine_started = time.monotonic()
        self.serving_since = None
        self.hub.configured = list(c.streams)
        self.server.launch()
        if c.openpi.port is not None:   # openpi clients beside the robots on topics: the same workers and admission
            from physis_ros.openpi import OpenpiFrontEnd

            self.openpi = OpenpiFrontEnd(self.server, log=logging.getLogger("physis.openpi"))
            self.openpi.start()
        self.executor.create_task(self._admit_config_streams())

    async def _admit_config_streams(self) -> None:
        """Once the workers are up, admit the config's streams one by one (rejections reported loudly)."""
        ticker = self.actions.ticker
        server = self.server
        while server is self.server and server.state == "starting":
            await ticker.sleep(0.05)
        if server is not self.server or server.state != "serving":
            return
        for name in list(self.hub.configured):
            try:
                await self.hub.join(name, self.config.streams[name], "config", ticker)
                server.startup[name] = "admitted"
            except Rejected as exc:
                server.startup[name] = f"{exc.reason}: {exc.detail}"
                if name not in self.streams:      # (not a goal's stream that took the name first)
                    self.params.remove_stream(name)   # no longer a stream of this server; its verdict is reported
                self.get_logger().error(f"config stream {name} NOT admitted ({exc.reason}): {exc.detail}")
        self.update_state()

    def stop_engine(self, timeout: float = 20.0) -> bool:
        """Stop the engine and its workers (no publishing afterwards); True if it stopped in time."""
        self.closing = True
        self.state = "stopping"
        for name in list(self.streams):
            self.actions.end(name, "shutdown", "the server is stopping")
        self.hub.forget_all()
        if self.openpi is not None:
            self.openpi.close()
            self.openpi = None
        done = self.server.close(timeout) if self.server is not None else True
        if self.server is not None:
            self.summary.update(self.server.report())
        self.server = None
        self.state = "stopped"
        return done

    def close(self, timeout: float = 20.0) -> bool:
        self.armed = False
        done = self.stop_engine(timeout)
        self.hub.close()
        rosout.detach(self._rosout)
        return done

    def destroy_node(self) -> None:
        # A destroyed node's logger must not keep taking the process's physis.* lines (a test, or an embedding
        # program, may create several nodes without close()).
        rosout.detach(self._rosout)
        super().destroy_node()

    # ---- lifecycle (executor thread) ----------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self.start_engine()   # returns at once; /diagnostics says "starting" until the workers serve
        except (ConfigError, OSError) as exc:   # the openpi front end could not listen: nothing half-started
            self.get_logger().error(f"configure failed: {exc}")
            self.stop_engine()
            return TransitionCallbackReturn.FAILURE
        self.lifecycle = "inactive"
        return SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        ret = super().on_activate(state)     # enables the lifecycle publishers
        self.armed, self.lifecycle = True, "active"
        self.get_logger().info("active: publishing the streams' outputs")
        return ret

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.armed, self.lifecycle = False, "inactive"
        ret = super().on_deactivate(state)   # disables them: nothing more goes out, chunks keep computing
        self.get_logger().info("inactive: outputs disarmed (telemetry and /diagnostics continue)")
        self.publish_diagnostics()
        return ret

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_engine()
        self.state, self.lifecycle, self.closing = "unconfigured", "unconfigured", False
        return SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.armed = False
        super().on_shutdown(state)
        self.stop_engine()
        self.lifecycle, self.finalized = "finalized", True
        return SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.armed = False
        self.stop_engine()
        self.state, self.lifecycle, self.closing = "unconfigured", "unconfigured", False
        return SUCCESS

    # ---- health (executor thread) -----------------------------------------------------------------
    def publish_diagnostics(self) -> None:
        if self.closing and self.state == "stopped":
            return
        self.update_state()
        statuses = diagnostics.statuses(self)
        if not self.closing:
            self.pub_diagnostics.publish(diagnostics.diagnostic_array(self.get_clock().now().to_msg(), statuses))

    def update_state(self) -> None:
        """The engine's state from its events: ``serving`` once the workers are up and every config stream
        has its verdict, ``failed`` (goals of streams that cannot come back end) on an engine failure."""
        engine = self.engine
        if engine is None:
            return
        failure = engine.failure
        if failure is not None:
            self.state = "failed"
            for name, st in list(self.streams.items()):   # streams that cannot come back end their goals
                if st.health.gone:
                    self.actions.end(name, "failed", str(failure))
            return
        startup_done = all(n in self.startup for n in self.hub.configured)
        if self.state == "starting" and engine.ready.is_set() and startup_done:
            self.state, self.serving_since = "serving", time.monotonic()
            admitted = [n for n, v in self.startup.items() if v == "admitted"]
            self.get_logger().info("engine ready: serving " + (", ".join(admitted) or "no stream yet; robots join "
                                                                "through ~/serve_stream"))

    def report(self) -> dict[str, Any]:
        """Totals per stream for the exit summary and tests (:meth:`Server.report`), the servers stopped before
        (a cleanup, a configure again) included."""
        return {**self.summary, **(self.server.report() if self.server is not None else {})}
