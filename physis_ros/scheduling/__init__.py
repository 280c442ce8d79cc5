"""Multi-stream joint scheduling (DESIGN.md section 3, layer 3; docs/scheduling.md).

``profiles``   cost profiles (runtime/costs.py's CostProfile): measured (physis-profile JSON) or
               roofline-modelled (H200)
``ranks``      virtual ranks: a stream's stages cut to fit its SLO with headroom
``cluster``    device state: time utilisation, memory, reference-counted shared weights
``admission``  requests, decisions, rejection reasons
``placement``  joint placement: Best-Fit guided by Limited Discrepancy Search
``equal``      the equal-split baseline
``simulator``  arrival sequences on N devices, joint vs equal (``physis-sim``)
"""

from physis_ros.runtime.costs import CostProfile, load_profile
from physis_ros.scheduling.admission import REASONS, Decision, StreamRequest
from physis_ros.scheduling.cluster import Cluster, PlacedStream
from physis_ros.scheduling.equal import EqualSplitScheduler
from physis_ros.scheduling.placement import JointScheduler
from physis_ros.scheduling.profiles import get_profile, roofline_profile
from physis_ros.scheduling.ranks import VirtualRank, equal_ranks, group_size, pack_ranks
from physis_ros.scheduling.settings import DeviceSpec, SchedulingConfig, load_device, load_scheduling

__all__ = ["REASONS", "Cluster", "CostProfile", "Decision", "DeviceSpec", "EqualSplitScheduler", "JointScheduler",
           "PlacedStream", "SchedulingConfig", "StreamRequest", "VirtualRank", "equal_ranks", "get_profile",
           "group_size", "load_device", "load_profile", "load_scheduling", "pack_ranks", "roofline_profile"]
