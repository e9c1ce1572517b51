"""benchmarks.backend_timeline reads a switch off the answers themselves: where the answering backend changes."""

from benchmarks.backend_timeline import latency_summary, switches_seen


def test_a_switch_is_where_the_answering_backend_changes():
    answers = [{"t_s": 1.0, "backend": "torch", "calibration": "torch-fp32"},
               {"t_s": 2.0, "backend": "torch", "calibration": "torch-fp32"},
               {"t_s": 3.0, "backend": None, "calibration": None},  # a failed request names no backend
               {"t_s": 4.0, "backend": "openvino-fp32", "calibration": "openvino-fp32"},
               {"t_s": 5.0, "backend": "openvino-int8", "calibration": "openvino-int8"}]
    assert switches_seen(answers) == [
        {"from": "torch", "to": "openvino-fp32", "last_old_answer_s": 2.0, "first_new_answer_s": 4.0,
         "calibration": "openvino-fp32"},
        {"from": "openvino-fp32", "to": "openvino-int8", "last_old_answer_s": 4.0, "first_new_answer_s": 5.0,
         "calibration": "openvino-int8"}]
    assert switches_seen(answers[:2]) == []


def test_latency_summary_of_nothing_says_so():
    assert latency_summary([]) == {"n": 0}
    assert latency_summary([1.0, 3.0])["p50_s"] == 2.0
